"""SGLang (0.5.23): DeepSeek-V4's ``FusedMoE`` experts under ``--moe-a2a-backend megamoe``.

The MegaMoE build contract. SGLang loads the checkpoint's MXFP4 experts into ``w13_weight`` /
``w2_weight`` (int8) and FP32 ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``; then
``Fp8MoEMethod`` post-processing calls ``mega_moe.py: build_mega_moe_experts_weights``, which
returns at once when ``_mega_moe_weights_built`` is set. What it leaves, and what installing
through :data:`CONTRACT` leaves:

- ``w13_weight``: the gate/up-interleaved weight; ``mega_l1_weights[0]`` is its ``.data``;
  ``w2_weight`` unchanged, ``mega_l2_weights[0]`` is its ``.data``.
- ``mega_w13_weight_scale_utccp`` / ``mega_w2_weight_scale_utccp``: new Parameters holding the
  UTCCP-transposed MN-major int32 scales, sharing storage with ``mega_l1_weights[1]`` /
  ``mega_l2_weights[1]`` (SGLang's EPLB moves parameters: the mega tensors must move with them).
- ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``: the same scales *without* the UTCCP
  transpose (DeepEP's path reads them), ``format_ue8m0 = True``. The rank files hold only the
  transposed ones, so these are derived on the module's device (a byte permutation).

SGLang builds the MTP (NextN) layer without expert location and redundant experts; the
conversion must hold SGLang's per-layer placement (``convert --engine sglang``), and every
module's physical-to-logical map is compared with it before anything is changed.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe_convert.engines.contract import Contract, EngineModule
from megamoe_convert.engines.probe import LayoutProbe
from megamoe_convert.engines.sglang.experts import check_ep_numbers
from megamoe_convert.engines.sglang.layout_probe import mega_moe_probe
from megamoe_convert.errors import InstallError
from megamoe_convert.layout import checks, inverse, scales
from megamoe_convert.serve.converted import ConvertedModel, Destinations, ExpertLayer
from megamoe_convert.source import engines_table
from megamoe_convert.source.layers import MoELayer

MARKERS = ("layer_name", "layer_id", "moe_ep_rank", "moe_ep_size", "moe_tp_size", "num_experts",
           "num_local_experts", "num_fused_shared_experts", "hidden_size", "intermediate_size_per_partition",
           "uses_expert_location", "quant_method", "_mega_moe_weights_built", "w13_weight", "w2_weight",
           "w13_weight_scale_inv", "w2_weight_scale_inv")
SCALES = ("w13_weight_scale_inv", "w2_weight_scale_inv")


def refusal(module: EngineModule) -> str | None:
    """What this module's MegaMoE mode is that the conversion's layout is not, if anything."""
    if module._mega_moe_weights_built:
        return "its MegaMoE weights are already built; install before SGLang's process_weights_after_loading"
    if getattr(module, "_mega_moe_w4a4", False):
        return "W4A4 MegaMoE (--enable-w4a4-mxfp4-megamoe) interleaves gate/up by 16, the conversion by 8"
    if getattr(module, "_mega_moe_nvfp4", False):
        return "NVFP4 MegaMoE experts are not the conversion's MXFP4 layout"
    if module.num_fused_shared_experts:
        return (f"{module.num_fused_shared_experts} fused shared expert slot(s) sit beside the routed experts; "
                "the conversion holds routed experts only (serve with shared-experts fusion disabled)")
    if not getattr(module.quant_method, "is_fp4_expert", False):
        return (f"{type(module.quant_method).__name__} does not take FP4 experts through fp8.py's MegaMoE build "
                "(the only path that skips its transform when _mega_moe_weights_built is set)")
    return None


def expect(module: EngineModule, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = getattr(module, name)
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
        raise InstallError(f"{module.layer_name}: {name} is {t.dtype}{list(t.shape)} with strides "
                           f"{list(t.stride())}, expected a contiguous {dtype}{list(shape)}")


class MegaMoEContract(Contract):
    name = "SGLang FusedMoE with --moe-a2a-backend megamoe (fp8.py, build_mega_moe_experts_weights)"

    def missing(self, module: EngineModule) -> list[str]:
        return [n for n in MARKERS if not hasattr(module, n)]

    def check(self, module: EngineModule, layer: MoELayer, converted: ConvertedModel, rank: int) -> None:
        where = module.layer_name
        why = refusal(module)
        if why:
            raise InstallError(f"{where}: cannot take pre-baked experts: {why}")
        if converted.weight_format != "mxfp4":
            raise InstallError(f"{where}: SGLang's fp8.py MegaMoE build takes MXFP4 experts, but {converted.path} "
                               f"holds {converted.weight_format}")
        placement, dims = converted.placement_for(layer), converted.manifest.dims
        h_rule, i_rule = engines_table.rows("sglang", weight_format="mxfp4")[0].shape
        if dims.hidden_size % h_rule or dims.moe_intermediate_size % i_rule:
            raise InstallError(f"{where}: SGLang's MegaMoE needs hidden_size % {h_rule} == 0 and "
                               f"moe_intermediate_size % {i_rule} == 0; {converted.path} has "
                               f"{dims.hidden_size} and {dims.moe_intermediate_size}")
        check_ep_numbers(module, where, layer, converted, rank)
        e, h, i = placement.experts_per_rank, dims.hidden_size, dims.moe_intermediate_size
        expect(module, "w13_weight", torch.int8, (e, 2 * i, h // 2))
        expect(module, "w2_weight", torch.int8, (e, h, i // 2))
        expect(module, "w13_weight_scale_inv", torch.float32, (e, 2 * i, h // checks.SCALE_BLOCK_K))
        expect(module, "w2_weight_scale_inv", torch.float32, (e, h, i // checks.SCALE_BLOCK_K))

    def shared_kinds(self, module: EngineModule, converted: ConvertedModel) -> tuple[str, ...]:
        """None: a module with fused shared-expert slots is refused (``refusal``)."""
        return ()

    def layout_probe(self, module: EngineModule, converted: ConvertedModel) -> LayoutProbe:
        """SGLang's own ``build_mega_moe_experts_weights`` on a scratch twin holding the probe's expert."""
        return mega_moe_probe(module, self.name)

    def destinations(self, module: EngineModule, converted: ConvertedModel) -> Destinations:
        """Weights into SGLang's own parameters; the UTCCP scales into new MN-major tensors on the
        module's device (SGLang's FP32 scale parameters are replaced, as its build does)."""
        e, n13, half_h = module.w13_weight.shape
        _, h, half_i = module.w2_weight.shape
        return {"l1_weight": module.w13_weight.data, "l1_sf": empty_sf_storage(e, n13, half_h * 2, module),
                "l2_weight": module.w2_weight.data, "l2_sf": empty_sf_storage(e, h, half_i * 2, module)}

    def finish(self, module: EngineModule, layer: ExpertLayer) -> None:
        for gemm, kernel, scale in (("l1", layer.l1, "w13"), ("l2", layer.l2, "w2")):
            utccp = kernel.sf
            assert utccp is not None  # MXFP4: both GEMMs carry scales
            getattr(module, f"{scale}_weight_scale_inv").data = inverse.untranspose_sf_for_utccp(utccp)
            getattr(module, f"{scale}_weight_scale_inv").format_ue8m0 = True
            setattr(module, f"mega_{gemm}_weights", (getattr(module, f"{scale}_weight").data, utccp))
            module.register_parameter(f"mega_{scale}_weight_scale_utccp", nn.Parameter(utccp, requires_grad=False))
        module._mega_moe_weights_built = True


def empty_sf_storage(experts: int, mn: int, k: int, module: EngineModule) -> torch.Tensor:
    """Contiguous int32 ``[E, K/128, MN]``: the storage of MN-major packed scales."""
    return torch.empty((experts, scales.packed_k(k), scales.tma_aligned_mn(mn)), dtype=torch.int32,
                       device=module.w13_weight.device)


CONTRACT = MegaMoEContract()
