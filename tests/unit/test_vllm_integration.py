"""``install`` edge cases on stand-ins of both vLLM contracts (no vLLM needed). vLLM's real
modules and loading are tested in tests/engines (run by test_engines_real.py), which also
checks these stand-ins against the real classes."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import run_cli
from vllm_stand_in import STAND_INS, experts_of, kernel_tensors, stand_in_model

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.engines.vllm import CONTRACTS, install
from megamoe_convert.engines.vllm.experts import layer_key
from megamoe_convert.errors import InstallError
from megamoe_convert.serve.loader import load_rank

KEYS = ["layers.0", "layers.1", "mtp.0"]


@pytest.fixture(autouse=True)
def stand_ins_have_no_loading_code_to_probe(monkeypatch):
    """The layout probe runs an engine's own loading code, which a stand-in lacks (it would refuse):
    these tests opt out explicitly. tests/engines probes the real code; test_probe.py the refusal."""
    monkeypatch.setenv("MEGAMOE_LAYOUT_PROBE", "0")


def test_layer_keys_map_vllm_prefixes_to_checkpoint_layers():
    assert layer_key("model.layers.7.ffn.experts", 43) == "layers.7"
    assert layer_key("model.layers.43.mtp_block.ffn.experts", 43) == "mtp.0"
    assert layer_key("model.layers.44.ffn.experts", 43) == "mtp.1"
    assert layer_key("model.mtp.0.ffn.experts", 43) == "mtp.0"
    with pytest.raises(InstallError, match="not a MegaMoE experts prefix"):
        layer_key("model.layers.7.mlp", 43)


@pytest.mark.parametrize("contract", sorted(STAND_INS))
def test_install_puts_the_rank_files_bytes_where_the_kernel_reads(tiny_converted, contract):
    model = stand_in_model(STAND_INS[contract], 3)
    assert install(model, tiny_converted, rank=3) == 3
    want = load_rank(tiny_converted, 3)
    for module, key in zip(experts_of(model), KEYS, strict=True):
        ref = want[f"{key}.ffn.experts"]
        for got, exp in zip(kernel_tensors(module), (*ref.l1, *ref.l2), strict=True):
            assert got.shape == exp.shape and got.stride() == exp.stride() and torch.equal(got.view(exp.dtype), exp)


@pytest.mark.parametrize("contract", sorted(STAND_INS))
def test_explicit_placement_is_refused_because_vllm_maps_slots_by_modulo(tiny_ckpt, tmp_path, contract):
    """vLLM's MegaMoE path assumes slot p holds expert p % n: a permuted placement would route
    tokens to the wrong experts, so install refuses it instead of serving wrong answers."""
    (tmp_path / "eplb.json").write_text(json.dumps([3, 2, 1, 0, 7, 6, 5, 4, 0, 1, 2, 3]))
    out = tmp_path / "eplb"
    # `convert` refuses this for vLLM (tests/test_convert.py); install's own refusal is the second line of defence
    convert(tiny_ckpt, out, ConvertOptions(4, placement_file=tmp_path / "eplb.json", experts_only=True,
                                           check_serving=False))
    model = stand_in_model(STAND_INS[contract], 1)
    with pytest.raises(InstallError, match="explicit expert placement"):
        install(model, out, rank=1)
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_a_conversion_for_sglangs_placement_is_refused(tiny_ckpt, tmp_path):
    out = tmp_path / "sglang"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 4, "--num-redundant-experts", 4, "--engine", "sglang",
            "--experts-only")
    model = stand_in_model(STAND_INS["kernel_layout"], 0)
    with pytest.raises(InstallError, match="converted for sglang's expert placement, not vllm's; convert with "
                                           "--engine vllm"):
        install(model, out, rank=0)


def test_a_layer_missing_from_the_conversion_is_refused(tiny_converted):
    model = stand_in_model(STAND_INS["kernel_layout"], 0, n_layers=3)
    with pytest.raises(InstallError, match=r"model.layers.3.mtp_block.ffn.experts: layer mtp.1 is not in"):
        install(model, tiny_converted, rank=0)


def test_a_model_without_megamoe_modules_is_refused(tiny_converted):
    with pytest.raises(InstallError, match="no MegaMoE experts modules"):
        install(torch.nn.Sequential(torch.nn.Linear(2, 2)), tiny_converted, rank=0)


def test_register_is_a_no_op_without_vllm(monkeypatch):
    from megamoe_convert.engines.vllm import plugin

    monkeypatch.setitem(sys.modules, "vllm", None)
    plugin.register()
    assert not plugin._registered  # nothing registered: a later process with vLLM registers everything


def test_every_contract_is_a_contract_and_binds():
    """The driver calls every method of :class:`Contract` on whichever contract detects a module;
    vLLM 0.30-0.32's contract binds to the module's owner, the others ignore it."""
    from megamoe_convert.engines.contract import Contract
    from megamoe_convert.engines.sglang import CONTRACTS as SGLANG_CONTRACTS

    owner = torch.nn.Module()
    for contract in (*CONTRACTS, *SGLANG_CONTRACTS):
        assert isinstance(contract, Contract)
        bound = contract.bind(owner)
        assert type(bound) is type(contract) and bound.name == contract.name
    assert CONTRACTS[1].bind(owner).owner is owner and CONTRACTS[0].bind(owner) is CONTRACTS[0]


def test_entry_point_is_declared():
    text = (__import__("pathlib").Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'megamoe = "megamoe_convert.engines.vllm.plugin:register"' in text
