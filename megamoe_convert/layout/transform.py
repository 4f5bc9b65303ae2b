"""The MegaMoE weight layout: the byte permutations DeepGEMM's fused kernel expects, forward only.

The spec is ``docs/megamoe-layout.md`` (from DeepGEMM's ``transform_sf_into_required_layout`` /
``transform_weights_for_mega_moe`` and vLLM's ``DeepseekV4MegaMoEExperts.finalize_weights``).
Every function here only moves bytes, so CPU and GPU produce identical output. Beside it:
``layout_checks`` (what the inputs must be), ``layout_scales`` (UE8M0 bytes packed MN-major, and
their file form), ``layout_sm90`` (Hopper's FP8 variant), ``layout_inverse`` (the transform undone,
and the dequantisation ``verify`` computes with).

Names follow the spec: ``E`` expert slots, ``H`` hidden size, ``I`` intermediate size,
``MN`` the row count of a matrix, ``K`` its reduction size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megamoe_convert.errors import LayoutError
from megamoe_convert.layout.checks import as_bytes, check_expert_tensors
from megamoe_convert.layout.scales import sf_into_required_layout

#: Gate/up rows are interleaved in runs of this many rows (DeepGEMM's ``_interleave_weights``).
GATE_UP_GRANULARITY = 8
#: The UTCCP scale transpose works on blocks of this many rows (4 x 32).
UTCCP_BLOCK_ROWS = 128


class KernelWeights(NamedTuple):
    """One GEMM's operands as the kernel takes them: ``(int8 weight, int32 MN-major scales)``."""

    weight: torch.Tensor
    sf: torch.Tensor | None


def interleave_gate_up(t: torch.Tensor, granularity: int = GATE_UP_GRANULARITY) -> torch.Tensor:
    """Rows ``[gate | up]`` -> ``[gate 0..7, up 0..7, gate 8..15, up 8..15, ...]`` (dim 1).

    Output row ``16b + j`` is gate row ``8b + j``; row ``16b + 8 + j`` is up row ``8b + j``.
    Keeps the input's memory format (so MN-major scales stay MN-major).
    """
    experts, rows, *rest = t.shape
    blocks = rows // 2 // granularity
    out = torch.empty_like(t)
    pairs = out.view(experts, blocks, 2, granularity, *rest)  # a view: each byte is written once, in place
    pairs[:, :, 0] = t[:, :rows // 2].reshape(experts, blocks, granularity, *rest)
    pairs[:, :, 1] = t[:, rows // 2:].reshape(experts, blocks, granularity, *rest)
    return out


def transpose_sf_for_utccp(sf: torch.Tensor) -> torch.Tensor:
    """Within each 128-row block, output row ``128c + 4j + i`` is input row ``128c + 32i + j``."""
    experts, mn, pk = sf.shape
    if mn % UTCCP_BLOCK_ROWS:
        raise LayoutError(f"UTCCP transpose needs MN % {UTCCP_BLOCK_ROWS} == 0, got MN={mn}")
    blocks = sf.reshape(experts, mn // UTCCP_BLOCK_ROWS, 4, 32, pk)
    return torch.empty_like(sf).copy_(blocks.transpose(2, 3).reshape(sf.shape))


def transform_experts(w13: torch.Tensor, w13_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor,
                      ) -> tuple[KernelWeights, KernelWeights]:
    """Per-rank checkpoint bytes -> ``(l1, l2)`` exactly as ``finalize_weights`` stores them.

    Inputs: ``w13 [E,2I,H/2]`` (rows: w1 then w3), ``w13_sf [E,2I,H/32]``, ``w2 [E,H,I/2]``,
    ``w2_sf [E,H,I/32]``, any 1-byte dtype. Outputs: ``l1 = (int8 [E,2I,H/2] contiguous,
    int32 [E,2I,H/128] MN-major)``, ``l2 = (int8 [E,H,I/2], int32 [E,H,I/128] MN-major)``,
    on the inputs' device.
    """
    check_expert_tensors(w13, w13_sf, w2, w2_sf)
    return (KernelWeights(l1_weight(w13), l1_sf(w13_sf)),
            KernelWeights(l2_weight(w2), l2_sf(w2_sf)))


# Each output depends on one input only, so a converter can produce them one at a time,
# in file order, for any subset of experts.

def l1_weight(w13: torch.Tensor) -> torch.Tensor:
    """L1 weight: gate/up row interleave of the packed FP4 bytes."""
    return interleave_gate_up(as_bytes(w13).view(torch.int8).contiguous())


def l1_sf(w13_sf: torch.Tensor) -> torch.Tensor:
    """L1 scales: packed MN-major, gate/up interleave, then the UTCCP transpose."""
    return transpose_sf_for_utccp(interleave_gate_up(sf_into_required_layout(w13_sf)))


def l2_weight(w2: torch.Tensor) -> torch.Tensor:
    """L2 weight: unchanged bytes."""
    return as_bytes(w2).view(torch.int8).contiguous()


def l2_sf(w2_sf: torch.Tensor) -> torch.Tensor:
    """L2 scales: packed MN-major, then the UTCCP transpose."""
    return transpose_sf_for_utccp(sf_into_required_layout(w2_sf))
