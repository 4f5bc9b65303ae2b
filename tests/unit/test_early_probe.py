"""The watch for a model's first MoE block (``engines/early_probe.py``) on torch's real module
registrations: it probes the first block that holds a detected experts module, once; it never removes
its hook while torch iterates over the hooks (another library's hook registered after it must keep
working); and it does nothing without a local conversion or with the probe switched off. The engines'
own modules run it in ``tests/engines`` (``test_*_layout_probe.py``)."""

from __future__ import annotations

import sys
import types

import pytest
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from megamoe_convert.engines import early_probe, probe


class Experts(nn.Module):
    """What the fake engine's contract detects."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts()
        self.shared = nn.Linear(2, 2)


@pytest.fixture
def engine(monkeypatch):
    """An install module as the watch reads one: its ``CONTRACTS`` and ``ENGINE``; the blocks the
    engine's ``classify`` is given, in order."""
    given: list[nn.Module] = []
    contract = types.SimpleNamespace(detect=lambda m: isinstance(m, Experts))
    module = types.ModuleType("fake_installing")
    module.CONTRACTS = (contract,)
    module.ENGINE = types.SimpleNamespace(classify=lambda block: given.append(block) or [])
    monkeypatch.setitem(sys.modules, "fake_installing", module)
    yield given
    early_probe.stop()
    probe.forget()


def _build(layers: int = 3) -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(4, 2)
    model.layers = nn.ModuleList(Block() for _ in range(layers))
    return model


def test_the_first_complete_block_is_probed_once(engine, tmp_path):
    early_probe.watch(str(tmp_path), "fake_installing")
    model = _build()
    early_probe.started().result()
    assert engine == [model.layers[0]]  # the block holding the first experts, with its shared linear


def test_a_hook_registered_after_the_watch_keeps_working(engine, tmp_path):
    """torch iterates over its registration hooks as it calls them: the watch must not remove its own
    from within one (``OrderedDict mutated during iteration`` would fail the engine's model build)."""
    early_probe.watch(str(tmp_path), "fake_installing")
    seen: list[str] = []
    handle = register_module_module_registration_hook(lambda parent, name, child: seen.append(name))
    try:
        _build()
    finally:
        handle.remove()
    early_probe.started().result()
    assert engine and seen.count("experts") == 3


def test_no_watch_without_a_local_conversion_or_with_the_probe_off(engine, tmp_path, monkeypatch):
    early_probe.watch("owner/repo", "fake_installing")  # a hub repo id: the install probes it
    _build()
    monkeypatch.setenv("MEGAMOE_LAYOUT_PROBE", "0")
    early_probe.watch(str(tmp_path), "fake_installing")
    _build()
    assert engine == [] and early_probe.started() is None


def test_a_block_built_before_the_install_module_is_imported_is_passed_over(engine, tmp_path, monkeypatch):
    early_probe.watch(str(tmp_path), "fake_installing")
    installing = sys.modules.pop("fake_installing")
    first = Block()
    holder = nn.Module()
    holder.block = first
    monkeypatch.setitem(sys.modules, "fake_installing", installing)
    model = _build(2)
    early_probe.started().result()
    assert engine == [model.layers[0]]


def test_a_watch_that_fails_never_breaks_the_model_build(engine, tmp_path, monkeypatch):
    """An error in the watch (here a contract whose check raises) leaves the engine's build as it was,
    ends the watch, and leaves the probe to the install."""
    def raising(module):
        raise AttributeError("a module unlike any the contract knows")

    monkeypatch.setattr(sys.modules["fake_installing"], "CONTRACTS", (types.SimpleNamespace(detect=raising),))
    early_probe.watch(str(tmp_path), "fake_installing")
    model = _build()
    assert len(model.layers) == 3 and engine == [] and early_probe.started() is None
