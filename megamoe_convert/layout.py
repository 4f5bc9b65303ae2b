"""The MegaMoE weight layout: the byte permutations DeepGEMM's fused kernel expects, forward only.

The spec is ``docs/megamoe-layout.md`` (from DeepGEMM's ``transform_sf_into_required_layout`` /
``transform_weights_for_mega_moe`` and vLLM's ``DeepseekV4MegaMoEExperts.finalize_weights``).
Every function here only moves bytes: nothing is computed from values, so CPU and GPU produce
identical output. The inverse, and the dequantisation ``verify`` computes with, are in
``layout_inverse``.

Names follow the spec: ``E`` expert slots, ``H`` hidden size, ``I`` intermediate size,
``MN`` the row count of a matrix, ``K`` its reduction size. FP4 weights are packed two to
a byte (``[N, K/2]``); UE8M0 scales are one byte per 32 K values (``[N, K/32]``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megamoe_convert.errors import LayoutError

#: Gate/up rows are interleaved in runs of this many rows (``_interleave_weights``).
GATE_UP_GRANULARITY = 8
#: The UTCCP scale transpose works on blocks of this many rows (4 x 32).
UTCCP_BLOCK_ROWS = 128
#: One UE8M0 scale byte covers this many K values (recipe ``(1, 32)``).
SCALE_BLOCK_K = 32
#: Scale bytes packed into one int32 word.
SCALES_PER_WORD = 4
#: TMA needs 16-byte aligned strides: 4 int32 words along MN.
TMA_ALIGN_INT32 = 4
#: H and I must be multiples of this (checked up front, as vLLM/DeepGEMM do).
DIM_MULTIPLE = 128


class KernelWeights(NamedTuple):
    """One GEMM's operands as the kernel takes them: ``(int8 weight, int32 MN-major scales)``."""

    weight: torch.Tensor
    sf: torch.Tensor | None


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------

def check_dims(hidden: int, intermediate: int, where: object = None) -> None:
    """The spec's up-front requirement: ``H % 128 == 0`` and ``I % 128 == 0`` (``where``: the file
    the sizes come from, named in the error)."""
    prefix = "" if where is None else f"{where}: "
    for name, value in (("hidden_size", hidden), ("moe_intermediate_size", intermediate)):
        if value <= 0 or value % DIM_MULTIPLE:
            raise LayoutError(f"{prefix}{name}={value} must be a positive multiple of {DIM_MULTIPLE}")


def as_bytes(t: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """Reinterpret a 1-byte tensor (uint8, int8, float4_e2m1fn_x2, float8_e8m0fnu...) as uint8.

    Never converts numerically: an e8m0 scale converted to float and back would lose the
    exponent byte's meaning, so bytes are only ever viewed.
    """
    if t.element_size() != 1:
        raise LayoutError(f"{name}: expected a 1-byte dtype (packed FP4 or UE8M0), got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _expect_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != shape:
        raise LayoutError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def expert_dims(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """``(E, H, I)`` read off the packed weight shapes ``[E, 2I, H/2]`` and ``[E, H, I/2]``."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise LayoutError(f"w13/w2 must be 3-D [E, N, K/2], got {list(w13.shape)} and {list(w2.shape)}")
    experts, two_i, half_h = w13.shape
    return experts, half_h * 2, two_i // 2


# --------------------------------------------------------------------------------------
# Step 1: UE8M0 scale bytes -> packed int32, MN-major, TMA-aligned
# --------------------------------------------------------------------------------------

def widen_ue8m0_to_fp32(sf: torch.Tensor) -> torch.Tensor:
    """What vLLM does before DeepGEMM: byte ``b`` becomes the FP32 whose bits are ``b << 23``."""
    return (as_bytes(sf).to(torch.int32) << 23).view(torch.float32)


def narrow_fp32_to_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's way back: the exponent bits ``bits >> 23``. Exact inverse of the widening."""
    return (sf.view(torch.int32) >> 23).to(torch.uint8)


def packed_k(k: int) -> int:
    """Number of int32 words holding the ``K/32`` scale bytes of one row."""
    return -(-(k // SCALE_BLOCK_K) // SCALES_PER_WORD)


def tma_aligned_mn(mn: int) -> int:
    """MN stride of an int32 scale tensor, rounded to 16 bytes."""
    return -(-mn // TMA_ALIGN_INT32) * TMA_ALIGN_INT32


def pack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """``uint8 [E, MN, K/32]`` -> contiguous ``int32 [E, MN, packed_k]``.

    Byte ``j`` of word ``q`` is ``sf[..., 4q + j]`` (little-endian); missing bytes are 0.
    """
    sf = as_bytes(sf, "scale")
    blocks = sf.shape[-1]
    pad = -blocks % SCALES_PER_WORD
    if pad:
        sf = torch.nn.functional.pad(sf, (0, pad))
    return _bytes_as_little_endian_int32(sf.contiguous())


def _bytes_as_little_endian_int32(b: torch.Tensor) -> torch.Tensor:
    """Assemble words arithmetically, so the result is independent of the host's byte order."""
    quads = b.reshape(*b.shape[:-1], -1, SCALES_PER_WORD).to(torch.int32)
    return quads[..., 0] | (quads[..., 1] << 8) | (quads[..., 2] << 16) | (quads[..., 3] << 24)


def to_mn_major(packed: torch.Tensor) -> torch.Tensor:
    """Contiguous ``int32 [E, MN, pk]`` -> the same values with strides ``(pk*MNa, 1, MNa)``.

    Physically a contiguous ``[E, pk, MNa]`` array, transposed; rows ``MN..MNa-1`` are padding.
    """
    experts, mn, pk = packed.shape
    mn_a = tma_aligned_mn(mn)
    storage = torch.zeros((experts, pk, mn_a), dtype=torch.int32, device=packed.device)
    storage[:, :, :mn] = packed.transpose(1, 2)
    return storage.transpose(1, 2)[:, :mn, :]


def expand_block_scales(sf: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """Coarse block scales ``[rows/br, blocks/bc]`` -> one byte per row and kernel group
    ``[rows, blocks]``: each block's byte repeated over the rows and groups it covers (a 128x128
    FP8 block scale covers 128 rows and four 1x32 groups). Bytes are copied, never converted."""
    sf = as_bytes(sf, "scale")
    return sf.repeat_interleave(rows // sf.shape[-2], -2).repeat_interleave(blocks // sf.shape[-1], -1)


def sf_into_required_layout(sf: torch.Tensor) -> torch.Tensor:
    """Step 1 whole: UE8M0 bytes -> packed, MN-major int32 (``transform_sf_into_required_layout``)."""
    return to_mn_major(pack_ue8m0(sf))


# --------------------------------------------------------------------------------------
# Step 2: row permutations (gate/up interleave, UTCCP transpose)
# --------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------
# The whole transform, as finalize_weights applies it
# --------------------------------------------------------------------------------------

def check_expert_tensors(w13: torch.Tensor, w13_sf: torch.Tensor,
                         w2: torch.Tensor, w2_sf: torch.Tensor) -> tuple[int, int, int]:
    """Validate the four per-rank inputs against each other; return ``(E, H, I)``."""
    experts, hidden, inter = expert_dims(w13, w2)
    check_dims(hidden, inter)
    _expect_shape(w13, (experts, 2 * inter, hidden // 2), "w13")
    _expect_shape(w13_sf, (experts, 2 * inter, hidden // SCALE_BLOCK_K), "w13_sf")
    _expect_shape(w2, (experts, hidden, inter // 2), "w2")
    _expect_shape(w2_sf, (experts, hidden, inter // SCALE_BLOCK_K), "w2_sf")
    for name, t in (("w13", w13), ("w13_sf", w13_sf), ("w2", w2), ("w2_sf", w2_sf)):
        as_bytes(t, name)
    return experts, hidden, inter


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


# --------------------------------------------------------------------------------------
# Storage form: how an MN-major scale tensor lives in a file, and comes back with a view
# --------------------------------------------------------------------------------------

def sf_storage(sf: torch.Tensor) -> torch.Tensor:
    """The contiguous ``[E, pk, MNa]`` array behind an MN-major scale tensor (a view, no copy)."""
    storage = sf.transpose(-1, -2)
    if not storage.is_contiguous():
        raise LayoutError(f"scale tensor with strides {sf.stride()} is not MN-major without padding")
    return storage


def sf_from_storage(storage: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`sf_storage`: the kernel's ``[E, MN, pk]`` MN-major view of the file bytes."""
    return storage.transpose(-1, -2)


# --------------------------------------------------------------------------------------
# SM90 (Hopper): SGLang's FP8 MegaMoE layout (``build_sm90_mega_moe_experts_weights``)
# --------------------------------------------------------------------------------------
#
# DeepGEMM's ``fp8_mega_moe`` takes FP8 e4m3 weights with FP32 128x128 block scales as the
# checkpoint stores them: only the L1 weight's gate/up rows move (the interleave above); the
# scales are neither packed, made MN-major nor UTCCP-transposed (``docs/megamoe-layout.md``, "SM90").

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
    _expect_shape(w2, (experts, hidden, inter), "w2")
    _expect_shape(as_fp32(w13_scale, "w13_scale"), (experts, two_i // block, hidden // block), "w13_scale")
    _expect_shape(as_fp32(w2_scale, "w2_scale"), (experts, hidden // block, inter // block), "w2_scale")
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
