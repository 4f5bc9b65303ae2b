"""SGLang's own MegaMoE build, run on the layout probe's synthetic expert (``engines/probe.py``).

A scratch twin of a real ``FusedMoE`` (one local expert, nothing of the real module written) holds
what SGLang's ``weight_loader`` leaves for one expert: ``w13_weight`` w1's rows then w3's, ``w2_weight``,
and the block scales as values in its scale parameters' dtype (a copy converts UE8M0 to FP32 as its
loader does). Then SGLang's own build runs on the twin, the one the quant method's post-processing
calls: ``mega_moe.build_mega_moe_experts_weights`` (SM100, DeepGEMM's
``transform_sf_into_required_layout``) or ``mega_moe_sm90.build_sm90_mega_moe_experts_weights``
(SM90 FP8); what it leaves in ``mega_l1_weights`` / ``mega_l2_weights`` is what the kernel reads.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch

from megamoe_convert.engines import probe
from megamoe_convert.engines.contract import EngineModule
from megamoe_convert.layout.identity import ProbeInput, Tensors


@functools.lru_cache(maxsize=1)
def engine_label() -> str:
    """``SGLang 0.5.23 (DeepGEMM 2.8.1)``: the release and the ``deep_gemm`` its build imports."""
    version = probe.package_version("sglang") or probe.module_version("sglang") or "(version unknown)"
    return f"SGLang {version} (DeepGEMM {probe.module_version('deep_gemm') or 'absent'})"


def _loaded(inp: ProbeInput) -> dict[str, torch.Tensor]:
    """One expert as SGLang's loader leaves it, by parameter (scales still in the checkpoint's dtype)."""
    out = {"w13_weight": inp.stacked(("w1", "w3"), "weight"), "w2_weight": inp.stacked(("w2",), "weight")}
    if ("w2", "scale") in inp.routed:
        out["w13_weight_scale_inv"] = torch.cat([inp.routed[p, "scale"] for p in ("w1", "w3")]).unsqueeze(0)
        out["w2_weight_scale_inv"] = inp.routed["w2", "scale"].unsqueeze(0)
    return out


def build_probe(module: EngineModule, build: Callable[[EngineModule], None], contract: str) -> probe.LayoutProbe:
    """The probe through ``build`` (SGLang's own build function for this module's MegaMoE mode)."""

    def run(inp: ProbeInput, shapes: Mapping[str, tuple[int, ...]]) -> Tensors:
        params = {}
        for name, value in _loaded(inp).items():
            real = getattr(module, name)
            params[name] = probe.like(real, tuple(value.shape))
            target = params[name].view(torch.uint8) if name.endswith("_weight") else params[name]
            target.copy_(value.view(torch.uint8) if name.endswith("_weight") else value)
        twin: EngineModule = probe.scratch_twin(module, params, num_local_experts=1, _mega_moe_weights_built=False)
        build(twin)
        (l1_weight, l1_sf), (l2_weight, l2_sf) = twin.mega_l1_weights, twin.mega_l2_weights
        return {"l1_weight": l1_weight, "l1_sf": l1_sf, "l2_weight": l2_weight, "l2_sf": l2_sf}

    return probe.LayoutProbe(engine_label(), module.layer_name, run, contract)


def mega_moe_probe(module: EngineModule, contract: str) -> probe.LayoutProbe:
    """SM100 (``--moe-a2a-backend megamoe``, MXFP4 experts)."""

    def build(twin: EngineModule) -> None:
        from sglang.srt.layers.moe import mega_moe

        mega_moe.build_mega_moe_experts_weights(twin)

    return build_probe(module, build, contract)


def sm90_probe(module: EngineModule, contract: str) -> probe.LayoutProbe:
    """SM90 (FP8 block-quantized experts)."""

    def build(twin: EngineModule) -> None:
        from sglang.srt.layers.moe import mega_moe_sm90

        mega_moe_sm90.build_sm90_mega_moe_experts_weights(twin)

    return build_probe(module, build, contract)
