"""SGLang's ``--load-format presharded`` over a conversion, through SGLang's real ``PreshardedModelLoader``:
its first run installs the pre-baked experts (the model's hooked ``load_weights``, as ``auto`` does)
and dumps them under ``OUT/presharded/``; its reload serves the same bytes without ``load_weights``,
the layout probe still guarding it; a dump of another conversion is never reloaded.

Only what the harness patches is patched, and the two functions that would build SGLang's whole
model (attention needs a GPU): ``_initialize_model`` builds the harness's tree of SGLang's own
classes, ``_get_quantization_config`` gives the quant config SGLang builds for DeepSeek-V4.
"""

from __future__ import annotations

import json
import shutil
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from unittest import mock

import pytest
import sglang_harness as h
import torch
from sglang.srt.layers.moe import mega_moe
from sglang_model_classes_harness import hooked_load_weights, plugins, tree_config
from test_sglang_layout_probe import _interleaved_by_16
from test_sglang_model_classes import assert_experts, reference

from megamoe_convert.engines import probe
from megamoe_convert.engines.sglang import presharded
from megamoe_convert.errors import InstallError

EP_SIZE, REDUNDANT = 4, 4


#: Each test probes the engine afresh (tests/engines/conftest.py).
pytestmark = pytest.mark.usefixtures("probes_afresh")


@pytest.fixture
def out(sglang_converted, tmp_path) -> Path:
    """A conversion of this test's own: SGLang dumps into it."""
    copy = tmp_path / "out"
    shutil.copytree(sglang_converted, copy)
    return copy


@contextmanager
def sglang_model(config, rank: int) -> Iterator[None]:
    """SGLang's loader module building the harness's tree (on whatever device SGLang asks: the
    structural signature builds one on ``meta``)."""
    from sglang.srt.model_loader import loader

    def initialize(model_config, load_config, quant_config=None):
        return h.build_on_any_device(model_config.hf_config, rank, REDUNDANT)

    with mock.patch.object(loader, "_initialize_model", initialize), \
            mock.patch.object(loader, "_get_quantization_config", lambda *_: h.quant_config()):
        yield


def presharded_load(out: Path, config) -> torch.nn.Module:
    """``launch_server --model-path OUT --load-format presharded``'s loading, by SGLang's own loader."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import PreshardedModelLoader, get_model_loader

    plugins()
    loader = get_model_loader(LoadConfig(load_format="presharded"))
    assert isinstance(loader, PreshardedModelLoader)
    model_config = types.SimpleNamespace(model_path=str(out), revision=None, hf_config=config, is_draft_model=False,
                                         quantization=None, dtype=torch.bfloat16)
    return loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))


def dumps(out: Path) -> list[Path]:
    return sorted(p.parent for p in (out / "presharded").glob("*/READY"))


def first_run(out: Path, ckpt: Path, rank: int) -> tuple[list[str], dict]:
    """The first start: what ``load_weights`` was fed, and SGLang's own loading of the source."""
    seen: list[str] = []
    want = reference(ckpt, rank)
    config = tree_config(ckpt, out)
    with sglang_model(config, rank), hooked_load_weights(h.DeepseekV4ForCausalLM, seen):
        model = presharded_load(out, config)
    assert_experts(model, want)
    return seen, want


def test_the_first_run_installs_the_experts_and_the_reload_serves_the_same_bytes(sglang_ckpt, out):
    with h.patched(3, EP_SIZE, REDUNDANT):
        seen, want = first_run(out, sglang_ckpt, 3)
        assert seen and not any(".experts." in n and ".shared_experts." not in n for n in seen)
        [dump] = dumps(out)
        assert json.loads((dump / presharded.STAMP_NAME).read_text())["conversion"] == str(out)
        assert json.loads((dump / "checksum.json").read_text())["shard_config"]["structural_signature"]
        config = tree_config(sglang_ckpt, out)
        fresh = h.build_main_model(config, 3, REDUNDANT)
        from megamoe_convert.engines.sglang import install
        install(fresh, out, rank=3)
        h.post_process(fresh)
        again: list[str] = []
        with sglang_model(config, 3), hooked_load_weights(h.DeepseekV4ForCausalLM, again):
            model = presharded_load(out, config)
        assert not again  # read from the dump alone
        assert_experts(model, want)  # SGLang's own loading of the source
        assert_experts(model, h.experts_of(fresh))  # a fresh megamoe install
        for module in h.experts_of(model).values():
            assert module._mega_moe_weights_built
            assert h.shares_storage(module.mega_l1_weights[1], module.mega_w13_weight_scale_utccp)
    assert dumps(out) == [dump]


def test_a_reload_under_a_release_laying_experts_out_otherwise_is_refused_in_one_line(sglang_ckpt, out):
    """The dump's signature (names, shapes, dtypes) cannot see a byte order: the probe does."""
    with h.patched(2, EP_SIZE, REDUNDANT):
        first_run(out, sglang_ckpt, 2)
        probe.forget()
        config = tree_config(sglang_ckpt, out)
        with sglang_model(config, 2), hooked_load_weights(h.DeepseekV4ForCausalLM, []), \
                mock.patch.object(mega_moe, "_interleave_mega_moe_l1_weights", _interleaved_by_16), \
                pytest.raises(InstallError) as e:
            presharded_load(out, config)
    message = str(e.value)
    assert "\n" not in message and message.startswith("SGLang 0.5.23 (DeepGEMM ")
    assert "lays out model.layers.0.mlp.experts l1.weight" in message and "do not serve this conversion" in message


def test_the_probe_on_reload_honours_the_opt_out_and_logs_it(sglang_ckpt, out, monkeypatch, caplog):
    with h.patched(1, EP_SIZE, REDUNDANT):
        _, want = first_run(out, sglang_ckpt, 1)
        probe.forget()
        monkeypatch.setenv("MEGAMOE_LAYOUT_PROBE", "0")
        config = tree_config(sglang_ckpt, out)
        with sglang_model(config, 1), hooked_load_weights(h.DeepseekV4ForCausalLM, []), caplog.at_level("WARNING"):
            assert_experts(presharded_load(out, config), want)
    assert any("layout probe skipped" in r.getMessage() for r in caplog.records)


def test_a_dump_of_another_conversion_is_never_reloaded(sglang_ckpt, out):
    """OUT converted again (``--force``) keeps SGLang's dump, the user's data; the reload refuses it."""
    with h.patched(0, EP_SIZE, REDUNDANT):
        first_run(out, sglang_ckpt, 0)
        [dump] = dumps(out)
        stamp = dump / presharded.STAMP_NAME
        recorded = json.loads(stamp.read_text())
        stamp.write_text(json.dumps({**recorded, "manifest_checksum": "0" * 32}))
        config = tree_config(sglang_ckpt, out)
        with sglang_model(config, 0), hooked_load_weights(h.DeepseekV4ForCausalLM, []):
            with pytest.raises(InstallError, match="made from another conversion than .* remove that folder"):
                presharded_load(out, config)
            stamp.unlink()
            with pytest.raises(InstallError, match="records no conversion"):
                presharded_load(out, config)
        assert (dump / "READY").is_file()
