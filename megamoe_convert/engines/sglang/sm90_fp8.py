"""SGLang (0.5.23) on Hopper: FP8 block-quantized ``FusedMoE`` experts under ``--moe-a2a-backend megamoe``.

The SM90 FP8 MegaMoE build contract (DeepSeek-V3/R1, Qwen3-MoE). SGLang loads the checkpoint's FP8
experts into ``w13_weight`` / ``w2_weight`` (``float8_e4m3fn``) and their FP32 128x128 block scales into
``w13_weight_scale_inv`` / ``w2_weight_scale_inv``; on SM90, ``Fp8MoEMethod`` post-processing then calls
``mega_moe_sm90.py: build_sm90_mega_moe_experts_weights``, which returns at once when
``_mega_moe_weights_built`` is set. What it leaves, and what installing through :data:`CONTRACT` leaves
(``docs/megamoe-layout.md``, "SM90"):

- ``w13_weight``: the gate/up rows interleaved 8 by 8; ``w2_weight`` unchanged;
- ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``: the FP32 block scales as loaded;
- ``mega_l1_weights = (w13_weight.data, w13_weight_scale_inv.data)``, ``mega_l2_weights`` likewise (the
  tuples alias the parameters, so SGLang's EPLB moves them together);
- ``_mega_moe_sm90_fp8_weights`` and ``_mega_moe_weights_built`` set.

Every byte goes straight into SGLang's own parameters. SGLang builds every MoE layer of these families,
the NextN (MTP) layer included, with expert location and redundant experts.
"""

from __future__ import annotations

import torch

from megamoe_convert.engines.contract import Contract, EngineModule
from megamoe_convert.engines.probe import LayoutProbe
from megamoe_convert.engines.sglang.experts import check_ep_numbers
from megamoe_convert.engines.sglang.layout_probe import sm90_probe
from megamoe_convert.engines.sglang.mega_moe import MARKERS, expect
from megamoe_convert.errors import InstallError
from megamoe_convert.serve.converted import ConvertedModel, Destinations, ExpertLayer
from megamoe_convert.source import formats
from megamoe_convert.source.layers import MoELayer

#: What the contract needs beyond the FusedMoE markers: FP8 weights (an MXFP4 module is the SM100 build's).
FP8_WEIGHT = "w13_weight as float8_e4m3fn (FP8 block-quantized experts)"


def refusal(module: EngineModule) -> str | None:
    """Why SGLang would not leave this module in the SM90 FP8 MegaMoE layout, if it would not."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend
    from sglang.srt.runtime_context import get_platform

    method = module.quant_method
    if module._mega_moe_weights_built:
        return "its MegaMoE weights are already built; install before SGLang's process_weights_after_loading"
    if not get_moe_a2a_backend().is_megamoe():
        return "SGLang builds MegaMoE weights only with --moe-a2a-backend megamoe"
    if not get_platform().is_sm90:
        return ("SGLang builds the FP8 MegaMoE weights on Hopper (SM90) only; on this GPU fp8.py lays FP8 experts out "
                "for DeepGEMM's grouped GEMMs instead")
    if module.num_fused_shared_experts:
        return (f"{module.num_fused_shared_experts} fused shared expert slot(s) sit beside the routed experts; "
                "the conversion holds routed experts only (serve with shared-experts fusion disabled)")
    if not getattr(method, "block_quant", False) or getattr(method, "use_mxfp8", False) or \
            getattr(method, "is_fp4_expert", False) or \
            list(getattr(method, "weight_block_size", None) or []) != [128, 128]:
        return (f"{type(method).__name__} does not hold 128x128 block-quantized FP8 experts (the only ones "
                "build_sm90_mega_moe_experts_weights takes)")
    return None


class Sm90Fp8Contract(Contract):
    name = ("SGLang FusedMoE with --moe-a2a-backend megamoe on SM90 (fp8.py, build_sm90_mega_moe_experts_weights)")

    def missing(self, module: EngineModule) -> list[str]:
        absent = [n for n in MARKERS if not hasattr(module, n)]
        if not absent and module.w13_weight.dtype != torch.float8_e4m3fn:
            absent.append(FP8_WEIGHT)
        return absent

    def check(self, module: EngineModule, layer: MoELayer, converted: ConvertedModel, rank: int) -> None:
        where = module.layer_name
        why = refusal(module)
        if why:
            raise InstallError(f"{where}: cannot take pre-baked experts: {why}")
        if converted.weight_format != formats.FP8_BLOCK.name:
            raise InstallError(f"{where}: SGLang's SM90 MegaMoE build takes {formats.FP8_BLOCK.name} experts, but "
                               f"{converted.path} holds {converted.weight_format}")
        placement, dims = converted.placement_for(layer), converted.manifest.dims
        check_ep_numbers(module, where, layer, converted, rank)
        e, h, i = placement.experts_per_rank, dims.hidden_size, dims.moe_intermediate_size
        fmt = formats.FP8_BLOCK
        expect(module, "w13_weight", torch.float8_e4m3fn, (e, 2 * i, h))
        expect(module, "w2_weight", torch.float8_e4m3fn, (e, h, i))
        expect(module, "w13_weight_scale_inv", torch.float32, (e, *fmt.scale_shape(2 * i, h)))
        expect(module, "w2_weight_scale_inv", torch.float32, (e, *fmt.scale_shape(h, i)))

    def shared_kinds(self, module: EngineModule, converted: ConvertedModel) -> tuple[str, ...]:
        """None: the SM90 kernel runs no shared expert (a module with fused shared slots is refused)."""
        return ()

    def layout_probe(self, module: EngineModule, converted: ConvertedModel) -> LayoutProbe:
        """SGLang's own ``build_sm90_mega_moe_experts_weights`` on a scratch twin holding the probe's expert."""
        return sm90_probe(module, self.name)

    def destinations(self, module: EngineModule, converted: ConvertedModel) -> Destinations:
        """Every tensor into SGLang's own parameters: the layout is theirs, byte for byte."""
        return {"l1_weight": module.w13_weight.data, "l1_sf": module.w13_weight_scale_inv.data,
                "l2_weight": module.w2_weight.data, "l2_sf": module.w2_weight_scale_inv.data}

    def finish(self, module: EngineModule, layer: ExpertLayer) -> None:
        module.mega_l1_weights = (module.w13_weight.data, module.w13_weight_scale_inv.data)
        module.mega_l2_weights = (module.w2_weight.data, module.w2_weight_scale_inv.data)
        module._mega_moe_sm90_fp8_weights = True
        module._mega_moe_weights_built = True


CONTRACT = Sm90Fp8Contract()
