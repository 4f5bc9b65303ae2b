"""The MegaMoE layout undone, and the values it holds: what ``verify --numerics`` computes with.

:mod:`layout` only moves bytes, so each of its steps has an exact inverse: undoing them gives back
the checkpoint's own bytes (``verify`` compares those with the source's, and the format table
dequantises them), and dequantising either form gives the dense matrices a reference MoE multiplies
with. Kept apart from the forward transform, which is all a converter or an engine needs.
"""

from __future__ import annotations

import torch

from megamoe_convert.layout.checks import SCALE_BLOCK_K, as_bytes, expert_dims
from megamoe_convert.layout.scales import widen_ue8m0_to_fp32
from megamoe_convert.layout.sm90 import as_fp32
from megamoe_convert.layout.transform import GATE_UP_GRANULARITY, UTCCP_BLOCK_ROWS
from megamoe_convert.source import formats


def inverse_transform_experts(l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor],
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Undo :func:`layout.transform_experts`: back to uint8 ``(w13, w13_sf, w2, w2_sf)``."""
    (l1_weight, l1_sf), (l2_weight, l2_sf) = l1, l2
    _, hidden, inter = expert_dims(l1_weight, l2_weight)
    w13 = deinterleave_gate_up(l1_weight.contiguous()).view(torch.uint8)
    w13_sf = unpack_ue8m0(deinterleave_gate_up(untranspose_sf_for_utccp(l1_sf)), hidden // SCALE_BLOCK_K)
    w2 = l2_weight.contiguous().view(torch.uint8)
    w2_sf = unpack_ue8m0(untranspose_sf_for_utccp(l2_sf), inter // SCALE_BLOCK_K)
    return w13, w13_sf, w2, w2_sf


def untransform_operand(weight: torch.Tensor, sf: torch.Tensor | None, scale_blocks: int, gate_up: bool,
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Undo :func:`layout.l1_weight` / ``l1_sf`` (``gate_up``) or :func:`layout.l2_weight` / ``l2_sf``
    for a weight of any element type (rows are moved whole, so FP4, FP8 and BF16 alike): its
    bytes ``uint8 [E, N, row bytes]`` and scale bytes ``uint8 [E, N, scale_blocks]`` (``None``
    for an unscaled weight), in checkpoint row order."""
    w = deinterleave_gate_up(weight.contiguous()) if gate_up else weight.contiguous()
    w = w.view(torch.uint8)
    if sf is None:
        return w, None
    s = untranspose_sf_for_utccp(sf)
    return w, unpack_ue8m0(deinterleave_gate_up(s) if gate_up else s, scale_blocks)


def deinterleave_gate_up(t: torch.Tensor, granularity: int = GATE_UP_GRANULARITY) -> torch.Tensor:
    """Inverse of :func:`layout.interleave_gate_up`."""
    experts, rows, *rest = t.shape
    pairs = t.reshape(experts, rows // (2 * granularity), 2, granularity, *rest)
    separated = torch.cat([pairs[:, :, 0], pairs[:, :, 1]], dim=1).reshape(t.shape)
    return torch.empty_like(t).copy_(separated)


def untranspose_sf_for_utccp(sf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`layout.transpose_sf_for_utccp`."""
    experts, mn, pk = sf.shape
    blocks = sf.reshape(experts, mn // UTCCP_BLOCK_ROWS, 32, 4, pk)
    return torch.empty_like(sf).copy_(blocks.transpose(2, 3).reshape(sf.shape))


def unpack_ue8m0(packed: torch.Tensor, blocks: int) -> torch.Tensor:
    """Inverse of :func:`layout_scales.pack_ue8m0`: ``int32 [E, MN, packed_k]`` -> ``uint8 [E, MN, blocks]``."""
    return _int32_as_little_endian_bytes(packed.contiguous())[..., :blocks]


def _int32_as_little_endian_bytes(w: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=w.device)
    quads = (w.unsqueeze(-1) >> shifts) & 0xFF
    return quads.to(torch.uint8).reshape(*w.shape[:-1], -1)


def sm90_inverse_transform_experts(l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor],
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Undo :func:`layout_sm90.sm90_transform_experts`:
    ``(w13 uint8, w13_scale float32, w2 uint8, w2_scale float32)``."""
    (l1_weight, l1_scale), (l2_weight, l2_scale) = l1, l2
    w13 = deinterleave_gate_up(as_bytes(l1_weight, "l1 weight").contiguous())
    return w13, as_fp32(l1_scale), as_bytes(l2_weight, "l2 weight").contiguous(), as_fp32(l2_scale)


# Dequantisation (FP4 e2m1 x UE8M0 -> float), of both forms

#: e2m1 code -> value; bit 3 is the sign. Nibble 2k is the low nibble of byte k.


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., K/2]`` -> e2m1 codes ``uint8 [..., K]``; element ``2k`` is the low nibble."""
    packed = as_bytes(packed, "fp4 weight")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def dequantize_fp4(packed: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Checkpoint form ``w [..., N, K/2]`` and ``sf [..., N, K/32]`` -> ``[..., N, K]`` values.

    Exact in float32 (and in bf16 whenever the scaled value fits its 8-bit exponent).
    """
    table = torch.tensor(formats.E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[unpack_fp4(packed).long()]
    scale = widen_ue8m0_to_fp32(sf).repeat_interleave(SCALE_BLOCK_K, dim=-1)
    return (values * scale).to(dtype)


def dequantize_checkpoint(w13: torch.Tensor, w13_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank checkpoint form -> ``(w13 [E, 2I, H], w2 [E, H, I])`` dense matrices."""
    return dequantize_fp4(w13, w13_sf, dtype), dequantize_fp4(w2, w2_sf, dtype)


def dequantize_transformed(l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor],
                           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel form -> the same ``(w13, w2)`` dense matrices (undo the permutations first)."""
    return dequantize_checkpoint(*inverse_transform_experts(l1, l2), dtype=dtype)


def dequantize_kernel(fmt: formats.WeightFormat, weight: torch.Tensor, sf: torch.Tensor | None, k: int, gate_up: bool,
                      global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same values from the kernel form (a rank file's ``l1`` / ``l2`` operand, scales
    MN-major): the layout's permutations undone (``gate_up``: the L1 interleave), then
    :func:`formats.dequantize`. ``k`` is the operand's reduction size (H for L1, I for L2)."""
    if fmt.kernel == "sm90":  # only the L1 weight's rows moved; the FP32 block scales are the checkpoint's
        raw = deinterleave_gate_up(weight.contiguous()) if gate_up else weight.contiguous()
        assert sf is not None
        return formats.dequantize(fmt, raw, sf)
    blocks = fmt.scale_row_bytes(k) if fmt.scaled else 0
    raw, raw_sf = untransform_operand(weight, sf if fmt.scaled else None, blocks, gate_up)
    return formats.dequantize(fmt, raw, raw_sf, global_scale)
