"""The MegaMoE layout transform against the spec (shared/docs/megamoe-transform.md).

The reference below is written independently of megamoe_convert.layout: plain loops over
row indices with the spec's formulas, numpy only, no reshapes shared with the code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_convert.layout import inverse, scales, transform
from megamoe_convert.layout.transform import LayoutError, transform_experts

# ----------------------------------------------------------------------------- reference


def ref_interleave_source_row(r: int, inter: int) -> int:
    """Spec: output row 16b+j <- gate row 8b+j; output row 16b+8+j <- up row 8b+j (w13 row I+8b+j)."""
    b, j = divmod(r, 16)
    return 8 * b + j if j < 8 else inter + 8 * b + (j - 8)


def ref_utccp_source_row(r: int) -> int:
    """Spec: output row 128c+4j+i <- input row 128c+32i+j."""
    c, rem = divmod(r, 128)
    j, i = divmod(rem, 4)
    return 128 * c + 32 * i + j


def ref_pack(sf: np.ndarray) -> np.ndarray:
    """Spec: byte j of word q is sf[..., 4q+j], little-endian; missing bytes 0."""
    n, blocks = sf.shape
    words = np.zeros((n, -(-blocks // 4)), dtype=np.uint32)
    for q in range(words.shape[1]):
        for j in range(4):
            if 4 * q + j < blocks:
                words[:, q] |= sf[:, 4 * q + j].astype(np.uint32) << np.uint32(8 * j)
    return words.view(np.int32)


def reference_transform(w13, w13_sf, w2, w2_sf):
    """Return numpy arrays of the four outputs' *values* (as the kernel indexes them)."""
    w13, w13_sf, w2, w2_sf = (t.numpy() for t in (w13, w13_sf, w2, w2_sf))
    experts, two_i, _ = w13.shape
    inter = two_i // 2
    hidden = w2.shape[1]
    l1w = np.empty_like(w13)
    l1sf = np.empty((experts, two_i, -(-w13_sf.shape[2] // 4)), dtype=np.int32)
    l2sf = np.empty((experts, hidden, -(-w2_sf.shape[2] // 4)), dtype=np.int32)
    for e in range(experts):
        packed13 = ref_pack(w13_sf[e])
        packed2 = ref_pack(w2_sf[e])
        for r in range(two_i):
            l1w[e, r] = w13[e, ref_interleave_source_row(r, inter)]
            l1sf[e, r] = packed13[ref_interleave_source_row(ref_utccp_source_row(r), inter)]
        for r in range(hidden):
            l2sf[e, r] = packed2[ref_utccp_source_row(r)]
    return l1w.view(np.int8), l1sf, w2.view(np.int8), l2sf


def random_experts(experts: int, hidden: int, inter: int, seed: int, scale_range=(0, 256)):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=g)

    lo, hi = scale_range
    return (rand(experts, 2 * inter, hidden // 2), rand(experts, 2 * inter, hidden // 32, lo=lo, hi=hi),
            rand(experts, hidden, inter // 2), rand(experts, hidden, inter // 32, lo=lo, hi=hi))


def mn_major_strides(experts: int, mn: int, pk: int) -> tuple[int, int, int]:
    mn_aligned = -(-mn // 4) * 4
    return (pk * mn_aligned, 1, mn_aligned)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("experts,hidden,inter", [(1, 128, 128), (3, 256, 128), (2, 512, 384)])
def test_transform_matches_spec_reference(experts, hidden, inter):
    inputs = random_experts(experts, hidden, inter, seed=experts * 1000 + hidden + inter)
    (l1w, l1sf), (l2w, l2sf) = transform_experts(*inputs)
    ref = reference_transform(*inputs)
    for got, want, name in zip((l1w, l1sf, l2w, l2sf), ref, ("l1w", "l1sf", "l2w", "l2sf"), strict=True):
        assert got.dtype == {np.int8: torch.int8, np.int32: torch.int32}[want.dtype.type], name
        assert tuple(got.shape) == want.shape, name
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)
    # Exactly the dtypes, shapes and strides finalize_weights stores.
    assert l1w.is_contiguous() and l2w.is_contiguous()
    assert tuple(l1sf.shape) == (experts, 2 * inter, hidden // 128)
    assert l1sf.stride() == mn_major_strides(experts, 2 * inter, hidden // 128)
    assert tuple(l2sf.shape) == (experts, hidden, inter // 128)
    assert l2sf.stride() == mn_major_strides(experts, hidden, inter // 128)
    # vLLM's EPLB views: weights contiguous; scales contiguous after transpose(1, 2).
    assert l1sf.transpose(1, 2).is_contiguous() and l2sf.transpose(1, 2).is_contiguous()


def test_l2_weight_bytes_unchanged():
    inputs = random_experts(2, 256, 256, seed=7)
    _, (l2w, _) = transform_experts(*inputs)
    assert torch.equal(l2w.view(torch.uint8), inputs[2])


def test_scale_widening_round_trips_every_byte():
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    widened = scales.widen_ue8m0_to_fp32(every_byte)
    assert widened.dtype == torch.float32
    assert torch.equal(widened.view(torch.int32), torch.arange(256, dtype=torch.int32) << 23)
    assert torch.equal(scales.narrow_fp32_to_ue8m0(widened), every_byte)


def test_pack_pads_missing_bytes_with_zero():
    sf = torch.tensor([[[1, 2, 3, 4, 5, 6]]], dtype=torch.uint8)
    packed = scales.pack_ue8m0(sf)
    assert packed.tolist() == [[[0x04030201, 0x00000605]]]
    assert torch.equal(inverse.unpack_ue8m0(packed, 6), sf)


def test_accepts_every_one_byte_storage_dtype():
    inputs = random_experts(2, 128, 128, seed=3)
    baseline = transform_experts(*inputs)
    w13, w13_sf, w2, w2_sf = inputs
    for wd, sd in ((torch.int8, torch.float8_e8m0fnu), (torch.float4_e2m1fn_x2, torch.uint8)):
        got = transform_experts(w13.view(wd), w13_sf.view(sd), w2.view(wd), w2_sf.view(sd))
        for a, b in zip((*got[0], *got[1]), (*baseline[0], *baseline[1]), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("hidden,inter", [(192, 128), (256, 64)])
def test_rejects_dims_not_multiple_of_128(hidden, inter):
    with pytest.raises(LayoutError, match="multiple of 128"):
        transform_experts(*random_experts(1, hidden, inter, seed=0))


def test_rejects_mismatched_shapes_and_wide_dtypes():
    w13, w13_sf, w2, w2_sf = random_experts(2, 256, 128, seed=0)
    with pytest.raises(LayoutError, match="w13_sf: expected shape"):
        transform_experts(w13, w13_sf[:, :, :4], w2, w2_sf)
    with pytest.raises(LayoutError, match="1-byte dtype"):
        transform_experts(w13, w13_sf, w2, w2_sf.to(torch.float32))


# ----------------------------------------------------------------------------- properties

dims = st.tuples(st.integers(1, 3), st.sampled_from([128, 256, 384]), st.sampled_from([128, 256]),
                 st.integers(0, 2**31))


@settings(max_examples=25, deadline=None)
@given(dims)
def test_inverse_of_transform_is_identity(d):
    experts, hidden, inter, seed = d
    inputs = random_experts(experts, hidden, inter, seed)
    back = inverse.inverse_transform_experts(*transform_experts(*inputs))
    for original, recovered in zip(inputs, back, strict=True):
        assert recovered.dtype == torch.uint8
        assert torch.equal(original, recovered)


@settings(max_examples=25, deadline=None)
@given(dims)
def test_every_output_byte_is_a_moved_input_byte(d):
    experts, hidden, inter, seed = d
    w13, w13_sf, w2, w2_sf = random_experts(experts, hidden, inter, seed)
    (l1w, l1sf), (l2w, l2sf) = transform_experts(w13, w13_sf, w2, w2_sf)

    def same_multiset(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(torch.bincount(a.reshape(-1).long(), minlength=256),
                           torch.bincount(b.reshape(-1).long(), minlength=256))

    sf_bytes = lambda sf: scales.sf_storage(sf).contiguous().view(torch.uint8)  # noqa: E731
    # H, I multiples of 128 => K/32 is a multiple of 4: no padding bytes at all.
    assert same_multiset(l1w.view(torch.uint8), w13) and same_multiset(sf_bytes(l1sf), w13_sf)
    assert same_multiset(l2w.view(torch.uint8), w2) and same_multiset(sf_bytes(l2sf), w2_sf)
    # ... and per expert: nothing moves between experts.
    for e in range(experts):
        assert same_multiset(l1w[e].view(torch.uint8), w13[e])


def test_row_permutations_are_bijections():
    """Track positions through the row permutations: each input row lands exactly once."""
    for rows in (128, 256, 512):
        ids = torch.arange(rows, dtype=torch.int64).reshape(1, rows, 1)
        for perm in (transform.interleave_gate_up, transform.transpose_sf_for_utccp):
            out = perm(ids).reshape(-1)
            assert sorted(out.tolist()) == list(range(rows))
        inter = rows // 2
        assert transform.interleave_gate_up(ids).reshape(-1).tolist() == [ref_interleave_source_row(r, inter)
                                                                        for r in range(rows)]
        utccp = transform.transpose_sf_for_utccp(ids).reshape(-1).tolist()
        assert utccp == [ref_utccp_source_row(r) for r in range(rows)]


@settings(max_examples=15, deadline=None)
@given(dims)
def test_batch_of_experts_equals_one_at_a_time(d):
    experts, hidden, inter, seed = d
    inputs = random_experts(experts, hidden, inter, seed)
    (l1w, l1sf), (l2w, l2sf) = transform_experts(*inputs)
    for e in range(experts):
        (a1w, a1sf), (a2w, a2sf) = transform_experts(*(t[e:e + 1] for t in inputs))
        assert torch.equal(a1w[0], l1w[e]) and torch.equal(a1sf[0], l1sf[e])
        assert torch.equal(a2w[0], l2w[e]) and torch.equal(a2sf[0], l2sf[e])


# ----------------------------------------------------------------------------- dequantisation

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def ref_dequant(packed: np.ndarray, sf: np.ndarray) -> np.ndarray:
    """Spec: low nibble is element 2k; value * 2**(byte - 127), one byte per 32 K values."""
    n, half_k = packed.shape
    out = np.empty((n, 2 * half_k), dtype=np.float64)
    table = np.array(E2M1)
    out[:, 0::2] = table[packed & 0x0F]
    out[:, 1::2] = table[packed >> 4]
    return out * np.repeat(2.0 ** (sf.astype(np.float64) - 127), 32, axis=1)


def test_dequantise_checkpoint_matches_reference():
    w13, w13_sf, w2, w2_sf = random_experts(2, 256, 128, seed=11, scale_range=(100, 150))
    d13, d2 = inverse.dequantize_checkpoint(w13, w13_sf, w2, w2_sf)
    for e in range(2):
        np.testing.assert_array_equal(d13[e].numpy(), ref_dequant(w13[e].numpy(), w13_sf[e].numpy()))
        np.testing.assert_array_equal(d2[e].numpy(), ref_dequant(w2[e].numpy(), w2_sf[e].numpy()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantised_transformed_equals_dequantised_checkpoint(dtype):
    inputs = random_experts(3, 384, 256, seed=5, scale_range=(100, 150))
    l1, l2 = transform_experts(*inputs)
    from_layout = inverse.dequantize_transformed(l1, l2, dtype=dtype)
    from_ckpt = inverse.dequantize_checkpoint(*inputs, dtype=dtype)
    for a, b in zip(from_layout, from_ckpt, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)
    # w1 / w3 halves are the gate and up matrices of the checkpoint, in order.
    inter = 256
    w1 = inverse.dequantize_fp4(inputs[0][:, :inter], inputs[1][:, :inter], dtype)
    assert torch.equal(from_layout[0][:, :inter], w1)


# ----------------------------------------------------------------------------- devices


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gives_the_same_bytes_as_cpu():
    inputs = random_experts(4, 1024, 512, seed=21)
    cpu = transform_experts(*inputs)
    gpu = transform_experts(*(t.cuda() for t in inputs))
    for a, b in zip((*cpu[0], *cpu[1]), (*gpu[0], *gpu[1]), strict=True):
        assert b.device.type == "cuda"
        assert a.stride() == b.stride() and a.dtype == b.dtype
        assert torch.equal(a, b.cpu())
    back = inverse.inverse_transform_experts(*gpu)
    assert all(torch.equal(x, y.cpu()) for x, y in zip(inputs, back, strict=True))
