"""The GPU path's staging: the work queue its readers share (CPU) and loads through the ring (CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import disk_folder, drop_from_page_cache, nowait_supported

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
              if i == 0 or (p.fd, p.file_offset) != (pieces[i - 1].fd,
                                                     pieces[i - 1].file_offset + pieces[i - 1].dest.numel())]
    assert starts == sorted((fd, offset) for fd, offset, _ in ranges), "pieces are not handed out in file order"
    for piece in pieces:  # every destination byte once, with the bytes of the file offset it stands for
        assert bool((piece.dest == 0).all()), "a destination byte handed out twice"
        piece.dest.copy_(torch.arange(piece.file_offset, piece.file_offset + piece.dest.numel()) % 251 + 1)
    for _, offset, dest in ranges:
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
        staging.fill_device([(fd, offset, d) for (offset, _), d in zip(spans, dests, strict=True)],
                            torch.device("cuda"))
        torch.cuda.synchronize()
    finally:
        os.close(fd)
    return dests


@gpu
@pytest.mark.parametrize("cudart", [True, False], ids=["cudart", "torch"])
def test_a_load_of_many_ranges_out_of_file_order_is_exact(tmp_path, monkeypatch, cudart):
    from megamoe_convert.serve import device_copy

    monkeypatch.setenv("MEGAMOE_CUDART", "1" if cudart else "0")
    device_copy.reset()
    path, data = _file(tmp_path, 48 << 20)
    spans = [(123, 9 << 20), (20 << 20, 7 << 20), (123, 9 << 20), (17, 3), ((30 << 20) + 5, (18 << 20) - 5)]
    for dest, (offset, n) in zip(_load(path, spans), spans, strict=True):
        assert torch.equal(dest.cpu(), data[offset:offset + n])
    # torch's CUDA runtime is found: the lanes' copies go through it, not through torch
    assert isinstance(device_copy.copier(), device_copy.CudartCopier if cudart else device_copy.TorchCopier)
    device_copy.reset()


@gpu
def test_a_range_past_the_files_end_fails_cleanly_and_the_next_load_is_exact(tmp_path):
    from megamoe_convert.source.safetensors_io import SafetensorsError

    path, data = _file(tmp_path, 8 << 20)
    with pytest.raises(SafetensorsError, match="end of file"):
        _load(path, [(0, 4 << 20), (6 << 20, 4 << 20)])
    dests = _load(path, [(1, (8 << 20) - 1)])
    assert torch.equal(dests[0].cpu(), data[1:])


# ----------------------------------------------------------------------------- the lanes, on the CPU


class _Event:
    pass


class _HostCopier:
    """The copier's surface in plain host memory: the lanes' logic without a GPU. Counts the
    copies still queued on each stream (none may be left when a load returns or raises)."""

    def __init__(self) -> None:
        self.queued: dict[int, int] = {}

    def bind(self, device) -> None:
        pass

    def copy(self, dest, src, stream) -> None:
        dest.copy_(src)
        self.queued[id(stream)] = self.queued.get(id(stream), 0) + 1

    def record(self, event, stream) -> None:
        pass

    def wait(self, event) -> None:
        pass

    def finish(self, stream) -> None:
        self.queued[id(stream)] = 0


class _Ring(staging.PinnedRing):
    """The ring's surface that the lanes use, in plain host memory."""

    def __init__(self, count: int, nbytes: int, lanes: int) -> None:
        self.nbytes, self._views, self.last_shape = nbytes, {}, None
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
        self.streams = [object() for _ in range(lanes)]

    def tools_for(self, device, parts=1):
        return [_Event() for _ in self.views(parts)], self.streams


def _lane_load(monkeypatch, path, spans, read_delay=0.0, fail_copy_at=None, reads=None, before_writes=None,
               copier=None, buffers=7):
    """``_lane_copy`` of ``spans`` with host destinations; the reads still running when it
    returned or raised are counted in the result's ``running``, the copies left queued in ``queued``."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    running, lock = [0], threading.Lock()
    real_read = staging.read_into

    def read_into(fd, offset, out, source=None):
        with lock:
            running[0] += 1
            if reads is not None:
                reads.append(out.numel())
        try:
            time.sleep(read_delay)
            real_read(fd, offset, out, source)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(staging, "read_into", read_into)
    monkeypatch.setenv("MEGAMOE_READ_THREADS", "3")  # a cold load runs twice as many: 6
    copier = copier or _HostCopier()
    if fail_copy_at is not None:
        real_copy, copies = copier.copy, [0]

        def copy(dest, src, stream):
            copies[0] += 1
            if copies[0] == fail_copy_at:
                raise RuntimeError("cudaMemcpyAsync failed: an illegal memory access was encountered")
            real_copy(dest, src, stream)
        copier.copy = copy
    fd = os.open(path, os.O_RDONLY)
    dests = [torch.zeros(n, dtype=torch.uint8) for _, n in spans]
    outcome = {"dests": dests}
    try:
        with ThreadPoolExecutor(4) as readers:
            try:
                queue = WorkQueue([(fd, o, d) for (o, _), d in zip(spans, dests, strict=True)])
                staging._lane_copy(queue, _Ring(buffers, 4096, 3), 0, readers, copier, before_writes,
                                   cold=not staging.in_page_cache(queue.ends))
            except Exception as e:  # noqa: BLE001 - the test looks at it
                outcome["error"] = e
            outcome["running"] = running[0]
            outcome["queued"] = sum(copier.queued.values())
    finally:
        os.close(fd)
    return outcome


def test_the_lanes_put_every_piece_where_it_belongs(tmp_path, monkeypatch):
    path, data = _file(tmp_path, 200_000)
    spans = [(7, 50_000), (100_000, 33_333), (7, 50_000), (199_999, 1)]
    outcome = _lane_load(monkeypatch, path, spans)
    assert "error" not in outcome and outcome["queued"] == 0
    for dest, (offset, n) in zip(outcome["dests"], spans, strict=True):
        assert torch.equal(dest, data[offset:offset + n])


def test_each_lane_reads_ahead_into_every_buffer_it_owns_before_its_first_write_waits_on_the_gate(
        tmp_path, monkeypatch):
    """The gate (an install's layout probe) holds back the writes, not the reads: each lane calls it
    once it has read into every buffer it owns, and no byte lands before the first call returns."""
    import collections
    import threading

    path, data = _file(tmp_path, 200_000)
    reads_by_lane: collections.Counter[int] = collections.Counter()
    real_read = staging.read_into

    def counted(fd, offset, out, source=None):
        reads_by_lane[threading.get_ident()] += 1
        real_read(fd, offset, out, source)

    monkeypatch.setattr(staging, "read_into", counted)
    copier, at_gate, lock = _HostCopier(), [], threading.Lock()

    def gate():
        with lock:
            at_gate.append((reads_by_lane[threading.get_ident()], sum(reads_by_lane.values()),
                            sum(copier.queued.values())))

    outcome = _lane_load(monkeypatch, path, [(0, 200_000)], before_writes=gate, copier=copier)
    assert "error" not in outcome and torch.equal(outcome["dests"][0], data)
    pieces = -(-200_000 // 4096)
    # _Ring(7, 4096, 3): the lanes own 3, 2 and 2 of its buffers; a lane calls the gate once they are
    # full, or once the queue ran out (a lane the others left no piece to never calls it)
    assert at_gate and all(mine in (2, 3) or total == pieces for mine, total, _ in at_gate), at_gate
    assert at_gate[0][2] == 0, "a byte was written before the gate first opened"


def test_a_gate_that_raises_leaves_every_destination_unwritten_and_no_read_running(tmp_path, monkeypatch):
    path, _ = _file(tmp_path, 100_000)

    def refuse():
        raise RuntimeError("the layout probe refused")

    outcome = _lane_load(monkeypatch, path, [(0, 100_000)], read_delay=0.002, before_writes=refuse)
    assert isinstance(outcome.get("error"), RuntimeError) and "layout probe" in str(outcome["error"])
    assert not outcome["dests"][0].any(), "bytes landed though the gate refused"
    assert outcome["running"] == 0 and outcome["queued"] == 0


def test_a_load_smaller_than_the_ring_still_opens_the_gate_and_lands_every_byte(tmp_path, monkeypatch):
    path, data = _file(tmp_path, 10_000)
    calls = []
    outcome = _lane_load(monkeypatch, path, [(0, 5_000), (6_000, 100)], before_writes=lambda: calls.append(1))
    assert "error" not in outcome and calls
    assert torch.equal(outcome["dests"][0], data[:5_000]) and torch.equal(outcome["dests"][1], data[6_000:6_100])


def test_a_failed_read_ends_every_read_in_flight_before_it_is_raised(tmp_path, monkeypatch):
    """A range past the file's end fails; the load raises that error only once no lane is still
    writing into a ring buffer (the next load would own them) and every lane's copies are done."""
    from megamoe_convert.source.safetensors_io import SafetensorsError

    path, _ = _file(tmp_path, 100_000)
    outcome = _lane_load(monkeypatch, path, [(0, 90_000), (95_000, 10_000)], read_delay=0.02)
    assert isinstance(outcome.get("error"), SafetensorsError) and "end of file" in str(outcome["error"])
    assert outcome["running"] == 0, "the error was raised while reads were still filling ring buffers"
    assert outcome["queued"] == 0, "the error was raised while copies were still queued"


def test_a_failed_copy_stops_every_lane_and_is_raised(tmp_path, monkeypatch):
    path, _ = _file(tmp_path, 100_000)
    outcome = _lane_load(monkeypatch, path, [(0, 100_000)], read_delay=0.005, fail_copy_at=4)
    assert isinstance(outcome.get("error"), RuntimeError) and "cudaMemcpyAsync failed" in str(outcome["error"])
    assert outcome["running"] == 0 and outcome["queued"] == 0


def _uncached_file(tmp_path, nbytes: int):
    """A file written and then dropped from the page cache."""
    path, data = _file(disk_folder(tmp_path), nbytes)
    drop_from_page_cache(path)
    return path, data


def test_a_load_tells_bytes_in_the_page_cache_from_bytes_on_disk(tmp_path):
    """The lanes' shape follows where the load's bytes are: a read that may not wait finds a file
    read a moment ago, and not one dropped from the page cache. Where the file system cannot
    answer such a read, every load is taken as warm (the lanes' shape before the cold one existed)."""
    path, _ = _uncached_file(tmp_path, 1 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        ranges = [(fd, 0, torch.empty(8192, dtype=torch.uint8)),
                  (fd, (1 << 20) - 100, torch.empty(100, dtype=torch.uint8))]
        dropped = staging.in_page_cache(ranges)
        os.pread(fd, 1 << 20, 0)
        assert staging.in_page_cache(ranges) is True
    finally:
        os.close(fd)
    assert dropped is (not nowait_supported(path))


def test_a_cold_load_runs_more_lanes_on_parts_of_the_buffers_and_every_piece_lands(tmp_path, monkeypatch):
    path, data = _file(tmp_path, 200_000)
    spans = [(7, 50_000), (100_000, 33_333), (7, 50_000), (199_999, 1)]
    loads = {"cold": [], "warm": []}
    for kind, reads in loads.items():
        with monkeypatch.context() as patch:  # each load's own read counter
            patch.setattr(staging, "in_page_cache", lambda ranges, cached=kind == "warm": cached)
            outcome = _lane_load(patch, path, spans, reads=reads)
            if kind == "cold":  # 6 cold lanes (as _lane_load sets them) over 7 buffers: each cut in 2
                assert staging.lane_shape(7, cold=True) == staging.LaneShape(6, 2)
        assert "error" not in outcome and outcome["queued"] == 0
        for dest, (offset, n) in zip(outcome["dests"], spans, strict=True):
            assert torch.equal(dest, data[offset:offset + n])
    assert max(loads["cold"]) == 4096 // 2, "a cold load read whole buffers, not their parts"
    assert max(loads["warm"]) == 4096


def test_a_warm_load_over_fewer_buffers_than_two_a_lane_cuts_them_so_every_lane_owns_two(tmp_path, monkeypatch):
    """A lane owning one buffer waits for its copy before it reads on: a small ring is cut in parts."""
    path, data = _file(tmp_path, 200_000)
    spans = [(7, 50_000), (100_000, 33_333), (199_999, 1)]
    reads: list[int] = []
    monkeypatch.setattr(staging, "in_page_cache", lambda ranges: True)
    outcome = _lane_load(monkeypatch, path, spans, reads=reads, buffers=4)
    assert staging.lane_shape(4, cold=False) == staging.LaneShape(3, 2)  # 3 lanes, 8 pieces
    assert "error" not in outcome and outcome["queued"] == 0
    for dest, (offset, n) in zip(outcome["dests"], spans, strict=True):
        assert torch.equal(dest, data[offset:offset + n])
    assert max(reads) == 4096 // 2
