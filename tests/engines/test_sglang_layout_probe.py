"""The layout probe against SGLang's own MegaMoE build: SGLang 0.5.23's ``build_mega_moe_experts_weights``
passes it; a release laying the same shapes out in another byte order is refused before any expert
is installed; one that changed its code but not its bytes is served; without DeepGEMM the probe
refuses unless the caller opts out, and the opt-out is logged."""

from __future__ import annotations

import logging
from pathlib import Path
from unittest import mock

import pytest
import sglang_harness as h
import torch
from layout_probe_common import assert_refused_unless_opted_out, engine_runs
from sglang.srt.layers.moe import mega_moe

from megamoe_convert.engines import early_probe, probe
from megamoe_convert.engines.load_formats import prepare_install
from megamoe_convert.engines.sglang import install
from megamoe_convert.errors import InstallError
from megamoe_convert.layout import identity
from megamoe_convert.source import formats

EP_SIZE, REDUNDANT = 4, 4
RELEASE = "SGLang 0.5.23"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


#: Each test probes the engine afresh (tests/engines/conftest.py).
pytestmark = pytest.mark.usefixtures("probes_afresh")


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter of every experts module, cloned, and whether its MegaMoE weights are built."""
    state = {}
    for prefix, module in h.experts_of(model).items():
        state.update({f"{prefix}.{k}": v.detach().clone() for k, v in module.named_parameters()})
        state[f"{prefix}._mega_moe_weights_built"] = torch.tensor(bool(module._mega_moe_weights_built))
    return state


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_install_probes_sglangs_own_build_once_per_process(sglang_ckpt, sglang_converted, caplog):
    config = h.hf_config(sglang_ckpt)
    with h.patched(1, EP_SIZE, REDUNDANT), caplog.at_level(logging.INFO):
        main, nextn = h.build_main_model(config, 1, REDUNDANT), h.build_nextn_model(config)
        install(main, sglang_converted, rank=1)
        install(nextn, sglang_converted, rank=1)
    passed = [r.getMessage() for r in caplog.records if "layout probe passed" in r.getMessage()]
    assert len(passed) == 1 and passed[0].startswith(f"megamoe: layout probe passed: {RELEASE} (DeepGEMM ")
    prints = identity.layout_fingerprints(formats.MXFP4, config.hidden_size, config.moe_intermediate_size)
    assert prints["routed"] in passed[0]


def test_the_probe_runs_on_the_first_moe_block_while_the_model_builds(sglang_ckpt, sglang_converted, monkeypatch):
    """What the model-class hook starts before SGLang builds the model (``prepare_install``) probes the
    first MoE block once it is complete, on the probe's thread; the install then runs SGLang's build no more."""
    config = h.hf_config(sglang_ckpt)
    runs = engine_runs(monkeypatch)
    with h.patched(1, EP_SIZE, REDUNDANT):
        prepare_install(str(sglang_converted), "megamoe_convert.engines.sglang.installing").join()
        main = h.build_main_model(config, 1, REDUNDANT)
        early_probe.started().result()  # the probe the build started, on the probe's thread
        assert [where for where, _ in runs] == ["model.layers.0.mlp.experts"]
        assert runs[0][1].startswith("megamoe-layout-probe")
        assert install(main, sglang_converted, rank=1) == config.num_hidden_layers
    assert len(runs) == 1


def _interleaved_by_16(l1_weights, mma_type):
    """A build interleaving gate/up by 16 rows (as SGLang's MXFP4 x MXFP4 mode does): same shapes."""
    return (mega_moe._interleave_mega_moe_gate_up(l1_weights[0], gran=16),
            mega_moe._interleave_mega_moe_gate_up(l1_weights[1], gran=16))


def test_a_release_laying_the_same_shapes_out_otherwise_is_refused_before_any_expert_is_installed(
        sglang_ckpt, sglang_converted):
    config = h.hf_config(sglang_ckpt)
    with h.patched(2, EP_SIZE, REDUNDANT):
        main = h.build_main_model(config, 2, REDUNDANT)
        before = _state(main)
        with mock.patch.object(mega_moe, "_interleave_mega_moe_l1_weights", _interleaved_by_16), \
                pytest.raises(InstallError) as e:
            install(main, sglang_converted, rank=2)
        assert _same(_state(main), before)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{RELEASE} (DeepGEMM ")
    assert f"model.layers.0.mlp.experts l1.weight (mxfp4, hidden {config.hidden_size}" in message
    assert "do not serve this conversion with it" in message and "--load-format megamoe" in message


def test_a_release_whose_code_changed_but_not_its_bytes_is_served(sglang_ckpt, sglang_converted):
    """The UTCCP transpose computed another way (an index gather) with the same bytes."""

    def gathered(sf):
        e, mn, k = sf.shape
        rows = torch.arange(mn).view(-1, 4, 32).transpose(1, 2).reshape(mn)
        return torch.empty_like(sf).copy_(sf[:, rows])

    config = h.hf_config(sglang_ckpt)
    with h.patched(3, EP_SIZE, REDUNDANT), mock.patch.object(mega_moe, "_transpose_mega_moe_sf_for_utccp", gathered):
        main = h.build_main_model(config, 3, REDUNDANT)
        assert install(main, sglang_converted, rank=3) == config.num_hidden_layers
        ref = h.build_main_model(config, 3, REDUNDANT)
        h.sglang_load(ref, sglang_ckpt)
    for prefix, module in h.experts_of(main).items():
        for name, tensor in h.state(module).items():
            h.assert_same_tensor(tensor, h.state(h.experts_of(ref)[prefix])[name], f"{prefix}.{name}")


def test_without_deep_gemm_the_probe_refuses_unless_the_caller_opts_out(sglang_ckpt, sglang_converted, caplog,
                                                                        monkeypatch):
    config = h.hf_config(sglang_ckpt)
    with h.patched(0, EP_SIZE, REDUNDANT), h.one_module("deep_gemm", None):
        main = h.build_main_model(config, 0, REDUNDANT)

        def opted_out() -> int:
            monkeypatch.setenv("MEGAMOE_LAYOUT_PROBE", "0")
            return install(main, sglang_converted, rank=0)

        assert_refused_unless_opted_out(lambda: _state(main), _same, lambda: install(main, sglang_converted, rank=0),
                                        opted_out, config.num_hidden_layers, "deep_gemm", caplog)


@pytest.mark.parametrize("family,preset", [("deepseek_v3", "deepseek-v3-tiny"), ("qwen3_moe", "qwen3-moe-tiny")])
def test_sglangs_sm90_build_lays_out_fp8_block_experts_as_the_conversion(family, preset):
    """Hopper's FP8 MegaMoE: ``build_sm90_mega_moe_experts_weights`` on the probe's expert, through the
    SM90 contract's probe, leaving the real module as it was."""
    import json
    import types

    import sglang_fp8_harness as fp8

    from megamoe_convert.engines.sglang import sm90_fp8

    config = types.SimpleNamespace(**json.loads((CONFIGS / f"{preset}.json").read_text()))
    with fp8.patched(0, EP_SIZE, REDUNDANT):
        module = next(iter(fp8.experts_of(fp8.build_main_model(family, config, 0, REDUNDANT)).values()))
        before = {k: v.detach().clone().view(torch.uint8) for k, v in module.named_parameters()}
        prints = probe.check_layout(sm90_fp8.CONTRACT.layout_probe(module, None), formats.FP8_BLOCK,
                                    config.hidden_size, config.moe_intermediate_size)
        assert all(torch.equal(v.detach().view(torch.uint8), before[k]) for k, v in module.named_parameters())
        assert not module._mega_moe_weights_built
    assert prints == identity.layout_fingerprints(formats.FP8_BLOCK, config.hidden_size, config.moe_intermediate_size)
