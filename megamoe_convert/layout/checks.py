"""What the MegaMoE transform takes, checked before any byte moves: dims, 1-byte views, shapes.

Kept apart from :mod:`layout` so the transform reads as its permutations; every check here
refuses in one line naming the tensor (or the file the sizes come from) and what was expected.
FP4 weights are packed two to a byte (``[N, K/2]``); UE8M0 scales are one byte per 32 K values
(``[N, K/32]``).
"""

from __future__ import annotations

import torch

from megamoe_convert.errors import LayoutError
from megamoe_convert.source.model_dims import check_dims

#: One UE8M0 scale byte covers this many K values (recipe ``(1, 32)``).
SCALE_BLOCK_K = 32




def as_bytes(t: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """Reinterpret a 1-byte tensor (uint8, int8, float4_e2m1fn_x2, float8_e8m0fnu...) as uint8.

    Never converts numerically: an e8m0 scale converted to float and back would lose the
    exponent byte's meaning, so bytes are only ever viewed.
    """
    if t.element_size() != 1:
        raise LayoutError(f"{name}: expected a 1-byte dtype (packed FP4 or UE8M0), got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def expect_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """Refuse ``t`` unless its shape is exactly ``shape``."""
    if tuple(t.shape) != shape:
        raise LayoutError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def expert_dims(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """``(E, H, I)`` read off the packed weight shapes ``[E, 2I, H/2]`` and ``[E, H, I/2]``."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise LayoutError(f"w13/w2 must be 3-D [E, N, K/2], got {list(w13.shape)} and {list(w2.shape)}")
    experts, two_i, half_h = w13.shape
    return experts, half_h * 2, two_i // 2


def check_expert_tensors(w13: torch.Tensor, w13_sf: torch.Tensor,
                         w2: torch.Tensor, w2_sf: torch.Tensor) -> tuple[int, int, int]:
    """Validate the four per-rank inputs against each other; return ``(E, H, I)``."""
    experts, hidden, inter = expert_dims(w13, w2)
    check_dims(hidden, inter)
    expect_shape(w13, (experts, 2 * inter, hidden // 2), "w13")
    expect_shape(w13_sf, (experts, 2 * inter, hidden // SCALE_BLOCK_K), "w13_sf")
    expect_shape(w2, (experts, hidden, inter // 2), "w2")
    expect_shape(w2_sf, (experts, hidden, inter // SCALE_BLOCK_K), "w2_sf")
    for name, t in (("w13", w13), ("w13_sf", w13_sf), ("w2", w2), ("w2_sf", w2_sf)):
        as_bytes(t, name)
    return experts, hidden, inter
