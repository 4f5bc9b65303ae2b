"""UE8M0 scale bytes in the form DeepGEMM's kernel reads them, and in the form a file keeps them.

The transform's first step (DeepGEMM's ``transform_sf_into_required_layout``): one byte per 32 K
values packed four to an int32 word, little-endian, stored MN-major with the MN stride rounded to
16 bytes for TMA. vLLM widens each byte to the FP32 whose exponent it is before calling DeepGEMM;
both directions are here, as bit moves. A file keeps an MN-major tensor as the contiguous array
behind it (:func:`sf_storage`), and a reader gets the kernel's view back without a copy.
"""

from __future__ import annotations

import torch

from megamoe_convert.errors import LayoutError
from megamoe_convert.layout.checks import SCALE_BLOCK_K, as_bytes
from megamoe_convert.source import formats

#: Scale bytes packed into one int32 word.
SCALES_PER_WORD = 4
#: TMA needs 16-byte aligned strides: 4 int32 words along MN.
TMA_ALIGN_INT32 = 4


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


def sf_into_required_layout(sf: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> packed, MN-major int32 (``transform_sf_into_required_layout``)."""
    return to_mn_major(pack_ue8m0(sf))


def expand_block_scales(sf: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """Coarse block scales ``[rows/br, blocks/bc]`` -> one byte per row and kernel group
    ``[rows, blocks]``: each block's byte repeated over the rows and groups it covers (a 128x128
    FP8 block scale covers 128 rows and four 1x32 groups). Bytes are copied, never converted."""
    sf = as_bytes(sf, "scale")
    return sf.repeat_interleave(rows // sf.shape[-2], -2).repeat_interleave(blocks // sf.shape[-1], -1)


def sf_storage(sf: torch.Tensor) -> torch.Tensor:
    """The contiguous ``[E, pk, MNa]`` array behind an MN-major scale tensor (a view, no copy)."""
    storage = sf.transpose(-1, -2)
    if not storage.is_contiguous():
        raise LayoutError(f"scale tensor with strides {sf.stride()} is not MN-major without padding")
    return storage


def sf_from_storage(storage: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`sf_storage`: the kernel's ``[E, MN, pk]`` MN-major view of the file bytes."""
    return storage.transpose(-1, -2)


def sf_kernel_view(fmt: formats.WeightFormat, stored: torch.Tensor) -> torch.Tensor:
    """The kernel's view of a rank file's scale tensor: MN-major (a transposed view of the file's
    storage), or for an SM90 format the stored FP32 block scales themselves."""
    return stored if fmt.kernel == "sm90" else sf_from_storage(stored)
