"""The layout probe against vLLM's own loading code: every format and shared-expert path of each release
passes it; a release laying the same shapes out in another byte order is refused before any expert
is installed; one that changed its code but not its bytes is served; a release whose code cannot
run the probe (DeepGEMM missing) is refused unless the caller opts out, and the opt-out is logged."""

from __future__ import annotations

import contextlib
import functools
import logging
from unittest import mock

import pytest
import torch
import vllm_harness as h
from layout_probe_common import assert_refused_unless_opted_out, engine_runs

from megamoe_convert.engines import early_probe, probe
from megamoe_convert.engines.load_formats import install_once, prepare_install
from megamoe_convert.engines.vllm import finalize, install, kernel_layout
from megamoe_convert.engines.vllm.installing import install_layers
from megamoe_convert.errors import InstallError
from megamoe_convert.layout import identity
from megamoe_convert.source import formats

EP_SIZE, REDUNDANT = 4, 4
RELEASE = f"vLLM {h.vllm.__version__}"


#: Each test probes the engine afresh (tests/engines/conftest.py).
pytestmark = pytest.mark.usefixtures("probes_afresh")


def _state(model) -> dict[str, torch.Tensor | None]:
    """Every tensor of every experts module a load writes (parameters, 0.33's L2 input-scale record,
    0.30-0.32's transformed tuples), cloned."""
    state: dict[str, torch.Tensor | None] = {}
    for prefix, module in h.experts_of(model).items():
        state.update({f"{prefix}.{k}": v.detach().clone() for k, v in module.named_parameters()})
        for name in ("_w2_input_scales", "_transformed_l1_weights", "_transformed_l2_weights"):
            value = getattr(module, name, None)
            for i, t in enumerate(value if isinstance(value, tuple) else (value,)):
                state[f"{prefix}.{name}[{i}]"] = None if t is None else t.detach().clone()
    return state


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte dtypes (FP8, packed FP4) compared as raw bytes: torch.equal has no FP8 kernel on every build."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(_bytes(x), _bytes(y)))
        for x, y in ((a[k], b[k]) for k in a))


def _probe(module, fmt, config, shared_inter=0, shared_mlp=None):
    contract = kernel_layout.CONTRACT if h.KERNEL_LAYOUT else finalize.CONTRACT
    layout_probe = (kernel_layout.kernel_layout_probe(module, kernel_layout.PARAMETERS, contract.name)
                    if h.KERNEL_LAYOUT
                    else finalize.finalize_probe(module, shared_mlp, finalize.LOADER_PARAMETERS, contract.name))
    return probe.check_layout(layout_probe, fmt, config.hidden_size, config.moe_intermediate_size, shared_inter)


def test_install_probes_vllms_own_loading_code_once_per_process(engine_ckpt, engine_converted, caplog):
    config = h.hf_config(engine_ckpt)
    with h.patched(1, EP_SIZE), caplog.at_level(logging.INFO):
        main = h.build_main_model(config, 1, EP_SIZE, REDUNDANT)
        mtp = h.build_mtp_model(config, 1, EP_SIZE, REDUNDANT)
        install(main, engine_converted, rank=1)
        install(mtp, engine_converted, rank=1)
    passed = [r.getMessage() for r in caplog.records if "layout probe passed" in r.getMessage()]
    assert len(passed) == 1 and passed[0].startswith(f"megamoe: layout probe passed: {RELEASE} (DeepGEMM ")


@pytest.mark.parametrize("shared", [False, pytest.param(True, marks=pytest.mark.since_032)])
def test_the_probe_runs_on_the_first_moe_block_while_the_model_builds(engine_ckpt, engine_converted, monkeypatch,
                                                                      shared):
    """What the model classes start before vLLM builds the model (``prepare_install``) probes the first
    MoE block once it is complete (0.32's with its shared MLP, which the probe fuses), on the probe's
    thread; the install then finds it passed and runs vLLM's code no more."""
    config = h.hf_config(engine_ckpt)
    runs = engine_runs(monkeypatch)
    with h.patched(1, EP_SIZE), h.fp8_linears() if shared else contextlib.nullcontext():
        prepare_install(str(engine_converted), "megamoe_convert.engines.vllm.installing").join()
        build = h.build_main_model_with_shared if shared else h.build_main_model
        model = build(config, 1, EP_SIZE, REDUNDANT)
        early_probe.started().result()  # the probe the build started, on the probe's thread
        assert [where for where, _ in runs] == ["model.layers.0.ffn.experts"]
        assert runs[0][1].startswith("megamoe-layout-probe")
        installed = install_layers(model, engine_converted, rank=1)
    assert len(runs) == 1 and installed.layers == tuple(f"layers.{i}" for i in range(config.num_hidden_layers))
    assert bool(installed.shared) == shared  # the probe fused the shared expert the install pre-bakes


def test_an_install_ends_the_watch_and_probes_a_model_built_before_it(engine_ckpt, engine_converted, monkeypatch):
    """A watch whose model never finished a MoE block (or whose blocks were built before the install's
    module was imported) ends at the model's install, which probes as it always does."""
    config = h.hf_config(engine_ckpt)
    runs = engine_runs(monkeypatch)
    with h.patched(1, EP_SIZE):
        model = h.build_main_model(config, 1, EP_SIZE, REDUNDANT)
        early_probe.watch(str(engine_converted), "megamoe_convert.engines.vllm.installing")
        assert early_probe._handle is not None
        install_once(model, str(engine_converted), functools.partial(install_layers, rank=1))
    assert early_probe._handle is None and len(runs) == 1 and runs[0][1].startswith("megamoe-layout-probe")


@pytest.mark.only_kernel_layout
@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "nvfp4", "bf16"])
def test_vllms_weight_loader_lays_out_every_format_as_the_conversion(engine_ckpt, name):
    config = h.hf_config(engine_ckpt)
    with h.patched(0, EP_SIZE):
        module = h.make_experts(config, "model.layers.0.ffn.experts", 0, EP_SIZE, REDUNDANT,
                                weight_format=h.mega_py.MEGA_MOE_WEIGHT_FORMATS[name])
        before = _state(module)
        prints = _probe(module, formats.FORMATS[name], config)
        assert _same(_state(module), before)  # the twin took the bytes, not the module
    assert prints == identity.layout_fingerprints(formats.FORMATS[name], config.hidden_size,
                                                  config.moe_intermediate_size)


@pytest.mark.since_032
def test_vllms_fused_shared_expert_path_lays_out_as_the_conversion(engine_ckpt):
    config = h.hf_config(engine_ckpt)
    s = config.moe_intermediate_size * config.n_shared_experts
    with h.patched(0, EP_SIZE), h.fp8_linears():
        model = h.build_main_model_with_shared(config, 0, EP_SIZE, REDUNDANT)
        moe = next(m for m in model.modules() if isinstance(m, h.model_py.DeepseekV4MoE))
        if not h.KERNEL_LAYOUT:
            moe.experts._check_runtime_supported()  # what the contract's check does first
        prints = _probe(moe.experts, formats.MXFP4, config, s, moe.shared_experts)
    assert prints == identity.layout_fingerprints(formats.MXFP4, config.hidden_size, config.moe_intermediate_size, s)
    assert set(prints) == {"routed", "shared"}


def _no_utccp_for_l2(dst, src, shard_id, is_scale):
    """A release that leaves the L2 scales' rows in order (no UTCCP transpose): same shapes, other bytes."""
    if shard_id == "w2" and is_scale:
        k = src.shape[-1]
        return dst.view(-1, 4, 32, k), src.reshape(-1, 4, 32, k)
    return ORIGINAL_SHARD(dst, src, shard_id, is_scale)


ORIGINAL_SHARD = h.mega_py.DeepGemmMegaMoEExperts._kernel_layout_shard if h.KERNEL_LAYOUT else None


def _future_release():
    """vLLM's own loading, permuting bytes differently with identical shapes: 0.33 its shard writer,
    0.30-0.32 DeepGEMM's L1 weight rows (each 32-row group in another order)."""
    if h.KERNEL_LAYOUT:
        return mock.patch.object(h.mega_py.DeepGemmMegaMoEExperts, "_kernel_layout_shard",
                                 staticmethod(_no_utccp_for_l2))
    from vllm.utils.deep_gemm import _import_deep_gemm

    deep_gemm = _import_deep_gemm()  # the DeepGEMM vLLM imported (once per process)
    original = deep_gemm.transform_weights_for_mega_moe

    def regrouped(l1, l2, **kwargs):
        (w, sf), l2_out = original(l1, l2, **kwargs)
        e, n, *rest = w.shape
        groups = w.view(e, n // 32, 2, 16, *rest)
        return (torch.empty_like(w).copy_(groups.transpose(2, 3).reshape(w.shape)), sf), l2_out

    return mock.patch.object(deep_gemm, "transform_weights_for_mega_moe", regrouped)


def test_a_release_laying_the_same_shapes_out_otherwise_is_refused_before_any_expert_is_installed(
        engine_ckpt, engine_converted):
    config = h.hf_config(engine_ckpt)
    with h.patched(2, EP_SIZE):
        main = h.build_main_model(config, 2, EP_SIZE, REDUNDANT)
        before = _state(main)
        with _future_release(), pytest.raises(InstallError) as e:
            install(main, engine_converted, rank=2)
        assert _same(_state(main), before)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{RELEASE} (DeepGEMM ")
    tensor = "l2.sf" if h.KERNEL_LAYOUT else "l1.weight"
    assert f"model.layers.0.ffn.experts {tensor} (mxfp4, hidden {config.hidden_size}" in message
    assert "do not serve this conversion with it" in message and "--load-format megamoe" in message


@pytest.mark.only_kernel_layout
def test_a_release_whose_code_changed_but_not_its_bytes_is_served(engine_ckpt, engine_converted):
    """A shard writer reached another way (through a contiguous staging copy) with the same bytes."""
    original = h.mega_py.DeepGemmMegaMoEExperts._load_weight

    def staged(self, dst, src, shard_id, is_scale):
        scratch = dst.detach().clone()
        original(self, scratch, src, shard_id, is_scale)
        dst.copy_(scratch)

    config = h.hf_config(engine_ckpt)
    with h.patched(3, EP_SIZE), mock.patch.object(h.mega_py.DeepGemmMegaMoEExperts, "_load_weight", staged):
        main = h.build_main_model(config, 3, EP_SIZE, REDUNDANT)
        assert install(main, engine_converted, rank=3) == config.num_hidden_layers
        ref = h.build_main_model(config, 3, EP_SIZE, REDUNDANT)
        ref.load_weights(h.checkpoint_weights(engine_ckpt))
    for prefix, module in h.experts_of(main).items():
        h.assert_same_tensors(h.kernel_view(module), h.kernel_view(h.experts_of(ref)[prefix]), prefix)


@pytest.mark.only_finalize
def test_without_deep_gemm_the_probe_refuses_unless_the_caller_opts_out(engine_ckpt, engine_converted, caplog):
    config = h.hf_config(engine_ckpt)
    # neither an installed nor vLLM's bundled deep_gemm imports: vLLM's import finds none
    with h.patched(0, EP_SIZE), mock.patch("vllm.utils.deep_gemm._import_deep_gemm", lambda: None):
        main = h.build_main_model(config, 0, EP_SIZE, REDUNDANT)
        assert_refused_unless_opted_out(lambda: _state(main), _same, lambda: install(main, engine_converted, rank=0),
                                        lambda: install(main, engine_converted, rank=0, probe=False),
                                        config.num_hidden_layers, "probe=False", caplog)
