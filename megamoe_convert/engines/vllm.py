"""vLLM >= 0.33: ``DeepGemmMegaMoEExperts`` (vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py).

The kernel-layout contract: the module registers ``w13_weight``, ``w13_weight_scale``,
``w2_weight`` and ``w2_weight_scale`` already in the kernel's layout (scales as the
``.transpose(-1, -2)`` of a contiguous int32 ``[E, K/128, MN]`` array) and its
``weight_loader`` fills them shard by shard; there is no finalize step. ``forward`` reads the
parameters through ``l1_weights`` / ``l2_weights`` and EPLB through ``named_parameters()``.

So installing is writing the rank file's bytes into those very Parameters' storage: the
Parameter objects, their ``weight_loader`` / ``quant_method``, dtype, shape and strides stay
exactly as vLLM made them. The fused shared expert (``shared_l*``) is not touched: it still
loads through vLLM's normal path.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import layout
from ..checkpoint import MoELayer
from ..loader import ConvertedModel, Destinations, ExpertLayer
from . import InstallError
from .vllm_common import EP_ATTRIBUTES, expect_tensor, require

#: Registered by every weight format; the scales only by the scaled ones (checked per format).
ROUTED_WEIGHTS = ("w13_weight", "w2_weight")
MARKERS = (*EP_ATTRIBUTES, "weight_format", "weight_loader", "l1_weights", "l2_weights", *ROUTED_WEIGHTS)


class KernelLayoutContract:
    name = "vLLM >= 0.33 DeepGemmMegaMoEExperts (parameters in the kernel layout)"

    def missing(self, module: nn.Module) -> list[str]:
        gone = require(module, MARKERS)
        if hasattr(module, "finalize_weights"):
            gone.append("no finalize_weights")
        return gone

    def detect(self, module: nn.Module) -> bool:
        return not self.missing(module) and all(n in module._parameters for n in ROUTED_WEIGHTS)

    def check(self, module: nn.Module, layer: MoELayer, converted: ConvertedModel, rank: int) -> None:
        fmt = getattr(module.weight_format, "name", module.weight_format)
        if fmt != converted.weight_format:
            raise InstallError(f"{module.prefix}: weight_format is {fmt} in the model but {converted.weight_format} "
                               f"in {converted.path}")
        e, h, i = module.num_local_experts, module.hidden_size, module.intermediate_size
        for name, mn, k in (("w13", 2 * i, h), ("w2", h, i)):
            want = layout.kernel_strides(e, mn, k)
            expect_tensor(module, f"{name}_weight", torch.int8, want["weight_shape"], want["weight_stride"])
            expect_tensor(module, f"{name}_weight_scale", torch.int32, want["sf_shape"], want["sf_stride"])

    def destinations(self, module: nn.Module) -> Destinations:
        return {"l1_weight": module.w13_weight.data, "l1_sf": layout.sf_storage(module.w13_weight_scale.data),
                "l2_weight": module.w2_weight.data, "l2_sf": layout.sf_storage(module.w2_weight_scale.data)}

    def finish(self, module: nn.Module, layer: ExpertLayer) -> None:
        """Nothing to set: the bytes are already in the Parameters vLLM reads."""


CONTRACT = KernelLayoutContract()
