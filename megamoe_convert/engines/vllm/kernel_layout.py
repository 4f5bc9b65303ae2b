"""vLLM >= 0.33: ``DeepGemmMegaMoEExperts`` (vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py).

The kernel-layout contract: the module registers ``w13_weight``, ``w13_weight_scale``,
``w2_weight`` and ``w2_weight_scale`` already in the kernel's layout (scales as the
``.transpose(-1, -2)`` of a contiguous int32 ``[E, K/128, MN]`` array) and its
``weight_loader`` fills them shard by shard; there is no finalize step. ``forward`` reads the
parameters through ``l1_weights`` / ``l2_weights`` and EPLB through ``named_parameters()``.

So installing is writing the rank file's bytes into those very Parameters' storage: the
Parameter objects, their ``weight_loader`` / ``quant_method``, dtype, shape and strides stay
exactly as vLLM made them. Per format (``formats.py``) that is the routed weights, their block
scales where the format has them, and NVFP4's per-expert FP32 scales (plus the module's record
of every logical expert's L2 input scale, whose maximum the kernel takes). A module that fuses
the shared expert (``has_fused_shared_experts``) also takes the pre-baked ``shared_l*`` tensors
when the conversion has them; otherwise its shared expert loads through vLLM's normal path.
"""

from __future__ import annotations

import torch

from megamoe_convert.engines.contract import Contract, EngineModule
from megamoe_convert.engines.probe import LayoutProbe
from megamoe_convert.engines.vllm.experts import EP_ATTRIBUTES, expect_kernel_tensors, require
from megamoe_convert.engines.vllm.layout_probe import kernel_layout_probe
from megamoe_convert.errors import InstallError
from megamoe_convert.serve.converted import ConvertedModel, Destinations, ExpertLayer
from megamoe_convert.source import formats
from megamoe_convert.source.layers import MoELayer

#: Registered by every weight format; the scales only by the scaled ones (checked per format).
ROUTED_WEIGHTS = ("w13_weight", "w2_weight")
MARKERS = (*EP_ATTRIBUTES, "weight_format", "weight_loader", "l1_weights", "l2_weights", *ROUTED_WEIGHTS)
#: Rank-file key -> the module's parameter holding it.
PARAMETERS = {
    "l1_weight": "w13_weight", "l1_sf": "w13_weight_scale", "l2_weight": "w2_weight", "l2_sf": "w2_weight_scale",
    "l1_global_scale": "w13_weight_scale_2", "l2_global_scale": "w2_weight_scale_2",
    "l2_input_scale": "w2_input_scale",
    "shared_l1_weight": "shared_l1_weight", "shared_l1_sf": "shared_l1_weight_scale",
    "shared_l2_weight": "shared_l2_weight", "shared_l2_sf": "shared_l2_weight_scale",
}


class KernelLayoutContract(Contract):
    name = "vLLM >= 0.33 DeepGemmMegaMoEExperts (parameters in the kernel layout)"

    def missing(self, module: EngineModule) -> list[str]:
        gone = require(module, MARKERS)
        if hasattr(module, "finalize_weights"):
            gone.append("no finalize_weights")
        return gone

    def detect(self, module: EngineModule) -> bool:
        return not self.missing(module) and all(n in module._parameters for n in ROUTED_WEIGHTS)

    def _keys(self, module: EngineModule, converted: ConvertedModel) -> list[str]:
        """The rank-file keys this module takes."""
        fmt = converted.manifest.dims.format
        keys = ["l1_weight", "l2_weight"] + (["l1_sf", "l2_sf"] if fmt.scaled else [])
        keys += list(formats.GLOBAL_SCALE_KEYS) if fmt.global_scales else []
        return keys + (list(formats.SHARED_KEYS) if self.shared_kinds(module, converted) else [])

    def shared_kinds(self, module: EngineModule, converted: ConvertedModel) -> tuple[str, ...]:
        """All of them when the module fuses the shared expert (vLLM decided at construction,
        it owns ``shared_l*``) and the conversion pre-baked it; otherwise none: the shared
        expert loads through vLLM's normal path."""
        fused = bool(getattr(module, "has_fused_shared_experts", False))
        return ("weight", "scale") if fused and converted.manifest.dims.shared_intermediate_size else ()

    def check(self, module: EngineModule, layer: MoELayer, converted: ConvertedModel, rank: int) -> None:
        fmt = getattr(module.weight_format, "name", module.weight_format)
        if fmt != converted.weight_format:
            raise InstallError(f"{module.prefix}: weight_format is {fmt} in the model but {converted.weight_format} "
                               f"in {converted.path}")
        expect_kernel_tensors(module, {k: PARAMETERS[k] for k in self._keys(module, converted)}, layer, converted)

    def layout_probe(self, module: EngineModule, converted: ConvertedModel) -> LayoutProbe:
        """The module's own ``weight_loader`` (and shared-expert loader) on the probe's expert."""
        return kernel_layout_probe(module, PARAMETERS, self.name)

    def destinations(self, module: EngineModule, converted: ConvertedModel) -> Destinations:
        dests = {key: _storage(getattr(module, PARAMETERS[key]).data, key) for key in self._keys(module, converted)}
        if converted.manifest.dims.format.global_scales:  # every logical expert's, as _record_global_scale keeps
            dests["l2_input_scale_all"] = module._w2_input_scales
        return dests

    def finish(self, module: EngineModule, layer: ExpertLayer) -> None:
        """NVFP4: the L2 activation scale vLLM derives while loading (the max over all experts)."""
        if "l2_input_scale_all" in layer.tensors:
            module.l2_activation_scale = float(module._w2_input_scales.max()) or 1.0


def _storage(t: torch.Tensor, key: str) -> torch.Tensor:
    """A parameter's bytes in the rank file's form (scales: the contiguous array behind the MN-major view)."""
    return t.transpose(-1, -2) if key.endswith("_sf") else t


CONTRACT = KernelLayoutContract()
