"""The GPU path's staging: the work queue its readers share (CPU) and loads through the ring (CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from megamoe_convert.serve import staging
from megamoe_convert.serve.staging import WorkQueue


def _ranges():
    """Two 'files', unaligned offsets, a duplicate (a redundant slot re-reads its expert's
    block) and ranges out of file order (a placement that wraps)."""
    sizes = [(3, 5000, 90_000), (3, 10, 700), (4, 1, 40_000), (3, 5000, 90_000), (4, 200_000, 1)]
    return [(fd, offset, torch.zeros(n, dtype=torch.uint8)) for fd, offset, n in sizes]


def test_readers_take_every_byte_once_in_file_order():
    ranges = _ranges()
    queue = WorkQueue(ranges)
    pieces = []
    while (piece := queue.take(16_000)) is not None:
        pieces.append(piece)
    assert all(p.dest.numel() <= 16_000 for p in pieces)
    # In file order: each range's pieces one after another, the ranges sorted by file and offset.
    starts = [(p.fd, p.file_offset) for i, p in enumerate(pieces)
              if i == 0 or (p.fd, p.file_offset) != (pieces[i - 1].fd, pieces[i - 1].file_offset + pieces[i - 1].dest.numel())]
    assert starts == sorted((fd, offset) for fd, offset, _ in ranges), "pieces are not handed out in file order"
    for piece in pieces:  # every destination byte once, with the bytes of the file offset it stands for
        assert bool((piece.dest == 0).all()), "a destination byte handed out twice"
        piece.dest.copy_(torch.arange(piece.file_offset, piece.file_offset + piece.dest.numel()) % 251 + 1)
    for fd, offset, dest in ranges:
        assert torch.equal(dest, (torch.arange(offset, offset + dest.numel()) % 251 + 1).to(torch.uint8))


def test_an_aborted_queue_hands_out_nothing():
    queue = WorkQueue(_ranges())
    assert queue.take(100) is not None
    queue.abort()
    assert queue.take(100) is None


# ----------------------------------------------------------------------------- GPU


def gpu(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def _file(tmp_path, nbytes: int):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, data


def _load(path, spans):
    """``spans`` ((offset, nbytes) of ``path``) into fresh device tensors by ``fill_device``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        dests = [torch.empty(n, dtype=torch.uint8, device="cuda") for _, n in spans]
        staging.fill_device([(fd, offset, d) for (offset, _), d in zip(spans, dests)], torch.device("cuda"))
        torch.cuda.synchronize()
    finally:
        os.close(fd)
    return dests


@gpu
def test_a_load_of_many_ranges_out_of_file_order_is_exact(tmp_path):
    path, data = _file(tmp_path, 48 << 20)
    spans = [(123, 9 << 20), (20 << 20, 7 << 20), (123, 9 << 20), (17, 3), ((30 << 20) + 5, (18 << 20) - 5)]
    for dest, (offset, n) in zip(_load(path, spans), spans):
        assert torch.equal(dest.cpu(), data[offset:offset + n])


@gpu
def test_a_range_past_the_files_end_fails_cleanly_and_the_next_load_is_exact(tmp_path):
    from megamoe_convert.source.safetensors_io import SafetensorsError

    path, data = _file(tmp_path, 8 << 20)
    with pytest.raises(SafetensorsError, match="end of file"):
        _load(path, [(0, 4 << 20), (6 << 20, 4 << 20)])
    dests = _load(path, [(1, (8 << 20) - 1)])
    assert torch.equal(dests[0].cpu(), data[1:])
