"""SM90 (Hopper): SGLang's FP8 MegaMoE layout (``build_sm90_mega_moe_experts_weights``).

DeepGEMM's ``fp8_mega_moe`` takes FP8 e4m3 weights with FP32 128x128 block scales as the
checkpoint stores them: only the L1 weight's gate/up rows move (:func:`layout.interleave_gate_up`);
the scales are neither packed, made MN-major nor UTCCP-transposed (``docs/megamoe-layout.md``, "SM90").
"""

from __future__ import annotations

import torch

from megamoe_convert.errors import LayoutError
from megamoe_convert.layout.checks import as_bytes, expect_shape
from megamoe_convert.layout.transform import KernelWeights, interleave_gate_up
from megamoe_convert.source.model_dims import check_dims

#: Rows and K values one FP32 block scale covers.
SM90_SCALE_BLOCK = 128


def as_fp32(t: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """FP32 block scales, given as float32 or as their bytes (a ``uint8`` view of the file)."""
    if t.dtype == torch.float32:
        return t
    if t.dtype != torch.uint8 or t.shape[-1] % 4:
        raise LayoutError(f"{name}: expected FP32 block scales (float32, or their bytes), got {t.dtype}{list(t.shape)}")
    return t.contiguous().view(torch.float32)


def sm90_check_experts(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                       ) -> tuple[int, int, int]:
    """Validate the four per-rank FP8 inputs against each other; return ``(E, H, I)``."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise LayoutError(f"w13/w2 must be 3-D [E, N, K], got {list(w13.shape)} and {list(w2.shape)}")
    experts, two_i, hidden = w13.shape
    inter = two_i // 2
    check_dims(hidden, inter)
    block = SM90_SCALE_BLOCK
    expect_shape(w2, (experts, hidden, inter), "w2")
    expect_shape(as_fp32(w13_scale, "w13_scale"), (experts, two_i // block, hidden // block), "w13_scale")
    expect_shape(as_fp32(w2_scale, "w2_scale"), (experts, hidden // block, inter // block), "w2_scale")
    for name, t in (("w13", w13), ("w2", w2)):
        as_bytes(t, name)
    return experts, hidden, inter


def sm90_l1_weight(w13: torch.Tensor) -> torch.Tensor:
    """L1 weight ``float8_e4m3fn [E, 2I, H]``: the gate/up row interleave (granularity 8) of the bytes."""
    return interleave_gate_up(as_bytes(w13, "w13").contiguous()).view(torch.float8_e4m3fn)


def sm90_transform_experts(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                           ) -> tuple[KernelWeights, KernelWeights]:
    """Per-rank FP8 checkpoint tensors -> ``(l1, l2)`` exactly as SGLang's SM90 build leaves them.

    Inputs: ``w13 [E,2I,H]`` (rows: gate then up) and ``w2 [E,H,I]``, any 1-byte dtype; their FP32
    block scales ``[E,2I/128,H/128]`` / ``[E,H/128,I/128]`` (float32 or their bytes). Outputs:
    ``l1 = (float8_e4m3fn [E,2I,H] interleaved, float32 scales as given)``, ``l2 = (w2, its scales)``.
    """
    sm90_check_experts(w13, w13_scale, w2, w2_scale)
    return (KernelWeights(sm90_l1_weight(w13), as_fp32(w13_scale).contiguous()),
            KernelWeights(as_bytes(w2, "w2").contiguous().view(torch.float8_e4m3fn), as_fp32(w2_scale).contiguous()))
