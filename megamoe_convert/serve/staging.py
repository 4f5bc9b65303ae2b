"""The GPU path's staging: pinned buffers filled by parallel reads, each reader copying its own to the device.

Each reader thread is a lane: it takes the next piece of the load (one queue of the load's ranges
in file order: a cold disk reads a store rank's gapped ranges in one sweep), reads it into one of
its own pinned buffers, and queues that buffer's device copy on its own stream at once, through
the CUDA runtime's entry points without the GIL (:mod:`.device_copy`). No thread serializes the
copies, and while one buffer is being copied the reader fills the next, so a warm first call runs
close to the page cache -> pinned -> device ceiling (each read is a memory copy by the kernel, one
core each: it takes many to keep up with a PCIe 5 host-to-device copy). A load whose bytes are not
in the page cache runs more lanes on smaller pieces (:func:`lane_shape`), of a larger ring where the
engine's conversion was not in the page cache either when the ring was pinned, or is large
(:func:`ring_buffers`): a disk wants more reads in flight than memory wants copiers. The buffers,
the lanes' streams and the reader threads are made once per process and reused by every load.

Pinning is the one cost a fresh process pays before its first byte moves. The ring is pinned with
``torch``'s pinned allocator: with every rank of a node pinning at once, registering huge pages from
several threads (:mod:`.pinning`, ``MEGAMOE_FAST_PIN=1``), faster for one process alone on some
hosts, took longer, held up the engine's own GPU allocations longer and loaded slower
(``benchmarks/bench_pin.py``, ``docs/benchmarks.md``). Engines start the pinning in the background
as they build the model (:func:`prepare_gpu_staging`), beside the build (which it slows).

Settings, read when a ring is made or a load starts (:mod:`megamoe_convert.settings`; a bad value is
refused in one line naming it):

- ``MEGAMOE_READ_THREADS`` (1..256; default: the CPU count, 4 to 16): the reader lanes of a warm
  load, a 16 MB pinned buffer each. A cold load runs twice as many (on twice the buffers where the
  ring was pinned for one, or for a large load). Lower it on a host whose cores or page-locked
  memory serve other work.
- ``MEGAMOE_FAST_PIN=1``: pin the ring by registering huge pages from several threads instead of
  with ``torch``'s allocator (which it falls back to where registering fails).
- ``MEGAMOE_CUDART=0``: issue the lanes' copies through ``torch`` instead of the CUDA runtime's
  entry points (what happens anyway where the runtime ``torch`` loaded cannot be found).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from megamoe_convert import settings
from megamoe_convert.serve import device_copy, pinning
from megamoe_convert.serve.residency import conversion_load, in_page_cache
from megamoe_convert.source.safetensors_io import read_into

#: Bytes of one pinned ring buffer: two 16 MB buffers a lane made the fastest first call, ahead of
#: more, smaller ones (``docs/benchmarks.md``).
RING_BUFFER_BYTES = 16 << 20
#: A rank's load from which a warm one through two buffers a lane is faster by more than pinning the
#: second costs (``docs/benchmarks.md``, ``benchmarks/bench_pin.py``).
LARGE_LOAD_BYTES = 8 << 30


def read_threads() -> int:
    """Reader lanes of a warm load (``MEGAMOE_READ_THREADS``)."""
    return settings.read_threads()


def ring_buffers(cold: bool = False, load_bytes: int = 0) -> int:
    """Buffers of the pinned ring the lanes share out: one a warm lane (cut in two: two pieces a
    lane), or two where the load will be cold (a disk reads faster with more bytes in flight) or
    large. The ring is pinned beside the engine's model build, which the pinning slows: a small warm
    load through the larger ring does not win that back (``benchmarks/bench_pin.py``)."""
    return (2 if cold or load_bytes >= LARGE_LOAD_BYTES else 1) * read_threads()


def cold_read_threads() -> int:
    """Lanes of a load whose first or last bytes are not in the page cache, each ring buffer then cut
    in as many parts as give every lane two (the same memory). A warm load is bound by memory
    bandwidth and the GIL and runs best with a lane per core; a cold one waits on the disk, which
    reads a store rank's gapped ranges faster with more, smaller reads in flight."""
    return 2 * read_threads()


@dataclass(frozen=True)
class LaneShape:
    """How a load's lanes share the ring: ``lanes`` readers, each ring buffer cut in ``parts``."""

    lanes: int
    parts: int


def lane_shape(buffers: int, cold: bool) -> LaneShape:
    """The lanes of a warm load (:func:`read_threads`) or a cold one (:func:`cold_read_threads`)
    over a ring of ``buffers`` buffers, every lane owning at least two pieces of it (the buffers
    cut in parts where they are fewer): a lane with one piece waits for its copy before it reads on."""
    lanes = cold_read_threads() if cold else read_threads()
    parts = max(1, -(-2 * lanes // buffers))
    return LaneShape(max(1, min(lanes, buffers * parts)), parts)


class PinnedRing:
    """Pinned host buffers shared out among the reader lanes, with one CUDA event per buffer (or
    part of one) and device (made once: making them per copy slowed a first call) and one
    stream per lane and device."""

    def __init__(self, count: int | None = None, nbytes: int = RING_BUFFER_BYTES) -> None:
        started = time.perf_counter()
        self.nbytes = nbytes
        self._events: dict[tuple[int, int], list[torch.cuda.Event]] = {}
        self._streams: dict[int, list[torch.cuda.Stream]] = {}
        self._views: dict[int, list[torch.Tensor]] = {}
        self._mapping: mmap.mmap | None = None  # owns the registered buffers' memory for the process's life
        count = ring_buffers() if count is None else count
        registered = self._registered(count, nbytes) if settings.fast_pin() else None
        self.buffers: list[torch.Tensor] = registered if registered is not None else [
            torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True) for _ in range(count)]
        #: When pinning ended (``time.perf_counter``) and how long it took: benchmarks report the wait.
        self.ready_at = time.perf_counter()
        self.pin_seconds = self.ready_at - started
        #: The lanes' shape of the last load (benchmarks report it).
        self.last_shape: LaneShape | None = None

    def _registered(self, count: int, nbytes: int) -> list[torch.Tensor] | None:
        try:
            block, mapping = pinning.huge_page_block(count * nbytes)
        except (OSError, ValueError):
            return None
        buffers = [block[i * nbytes:(i + 1) * nbytes] for i in range(count)]
        if not pinning.register(buffers):
            return None  # the mapping goes with the last view of it
        self._mapping = mapping
        return buffers

    def views(self, parts: int) -> list[torch.Tensor]:
        """Every buffer cut in ``parts`` equal pieces, in order (``parts=1``: the buffers)."""
        if parts not in self._views:
            size = self.nbytes // parts
            self._views[parts] = [b[j * size:(j + 1) * size] for b in self.buffers for j in range(parts)]
        return self._views[parts]

    def tools_for(self, device: torch.device | int, parts: int = 1,
                  ) -> tuple[list[torch.cuda.Event], list[torch.cuda.Stream]]:
        """The events of :meth:`views` ``(parts)`` and the lanes' streams (enough for a warm or a
        cold load) for ``device``, made on first use (callers hold :data:`RING_LOCK`, or own the
        ring before it is shared)."""
        index = torch.cuda._get_device_index(device, optional=True)
        with torch.cuda.device(index):
            if index not in self._streams:
                most = max(lane_shape(len(self.buffers), cold).lanes for cold in (False, True))
                self._streams[index] = [torch.cuda.Stream(device=index) for _ in range(most)]
            if (index, parts) not in self._events:
                streams = self._streams[index]
                # Blocking events: a lane waiting for its buffer's copy sleeps instead of spinning a core.
                events = [torch.cuda.Event(blocking=True) for _ in self.views(parts)]
                for slot, event in enumerate(events):
                    event.record(streams[slot % len(streams)])  # made now: the runtime's calls need a real event
                self._events[index, parts] = events
        return self._events[index, parts], self._streams[index]


_RING: PinnedRing | None = None
_PINNING: threading.Thread | None = None  # the background pinning, once started
_PIN_LOCK = threading.Lock()
_READERS: ThreadPoolExecutor | None = None
RING_LOCK = threading.Lock()


def shared_ring(buffers: int | None = None) -> PinnedRing:
    """One pinned ring per process, pinned once, ideally early (:func:`prepare_gpu_staging`),
    never per call (``buffers``: its size, where this makes it). Calls that use it hold
    :data:`RING_LOCK`."""
    global _RING
    with RING_LOCK:
        if _RING is None:
            _RING = PinnedRing(buffers)
        return _RING


def reader_count() -> int:
    """Reader threads the process keeps: enough for a warm or a cold load's lanes."""
    return max(read_threads(), cold_read_threads())


def shared_readers() -> ThreadPoolExecutor:
    """The process's reader threads (idle ones cost nothing; starting them per call did)."""
    global _READERS
    with RING_LOCK:
        if _READERS is None:
            _READERS = ThreadPoolExecutor(reader_count(), thread_name_prefix="megamoe-read")
        return _READERS


def _start_readers() -> None:
    """Start every reader thread now (a pool starts them one per submit, in the first load)."""
    readers = shared_readers()
    count = reader_count()
    everyone = threading.Barrier(count)
    list(readers.map(lambda _: everyone.wait(timeout=10), range(count)))


def ring_for(conversion: str | os.PathLike[str] | None) -> int:
    """The ring's buffers for loading ``conversion`` (``None``: a warm load's)."""
    cached, load_bytes = conversion_load(conversion) if conversion is not None else (True, 0)
    return ring_buffers(not cached, load_bytes)


def _prepare(device: int, conversion: str | os.PathLike[str] | None) -> None:
    ring = shared_ring(ring_for(conversion))
    with RING_LOCK:
        for cold in (False, True):
            ring.tools_for(device, lane_shape(len(ring.buffers), cold).parts)
    device_copy.copier(settings.cudart())  # found now (it reads the process's mappings), not in the first load
    try:
        _start_readers()
    except threading.BrokenBarrierError:  # a load took some of the threads meanwhile: they exist
        pass


def prepare_gpu_staging(conversion: str | os.PathLike[str] | None = None) -> threading.Thread | None:
    """Pin the staging ring, start the reader threads, make the caller's device's events and
    streams and find the CUDA runtime, in the background, now. Engines call this when their model
    is made, so all of it overlaps building the model instead of delaying the first load; a load
    that starts before it is done waits for the ring. ``conversion``: the one the engine will load,
    which sizes the ring: its files out of the page cache, or a large share of it a rank, give it two
    buffers a lane (:func:`ring_buffers`). Does nothing without CUDA, or once started."""
    global _PINNING
    if not torch.cuda.is_available():
        return None
    with _PIN_LOCK:
        if _RING is not None or _PINNING is not None:
            return None
        # Not a daemon: a process that ends (or fails) while the ring is being pinned waits the few
        # milliseconds left instead of tearing CUDA down under a registration (which aborts it).
        _PINNING = threading.Thread(target=_prepare, args=(torch.cuda.current_device(), conversion),
                                    name="megamoe-pin")
        _PINNING.start()
        return _PINNING


#: Called before a load's first write into its destinations (an install's layout probe): it returns
#: once they may be written, or raises to stop the load with nothing written (``None``: at once).
BeforeWrites = Callable[[], None] | None


@dataclass
class Piece:
    """One read of a file range into (a slice of) a device tensor."""

    fd: int
    file_offset: int
    dest: torch.Tensor  # flat uint8 view of the destination, on the GPU


class WorkQueue:
    """A load's ranges in file order (a disk reads them in one sweep), handed out a piece at a
    time to whichever reader comes free. Pieces are as large as a ring buffer to the end: pieces
    shrinking over the load's tail (guided self-scheduling) made first calls slower, not faster."""

    def __init__(self, ranges: Iterable[tuple[int, int, torch.Tensor]]) -> None:
        self._ranges = sorted(ranges, key=lambda r: (r[0], r[1]))
        #: The load's first and last ranges (in file order), whose residency picks the lanes' shape.
        self.ends = [self._ranges[i] for i in sorted({0, len(self._ranges) - 1})] if self._ranges else []
        self._at, self._done = 0, 0  # the range being handed out, and its bytes handed out
        self._lock = threading.Lock()

    def take(self, most: int) -> Piece | None:
        """The next piece of at most ``most`` bytes, ``None`` once all is handed out."""
        with self._lock:
            if self._at >= len(self._ranges):
                return None
            fd, offset, dest = self._ranges[self._at]
            n = min(most, dest.numel() - self._done)
            piece = Piece(fd, offset + self._done, dest[self._done:self._done + n])
            self._done += n
            if self._done == dest.numel():
                self._at, self._done = self._at + 1, 0
            return piece

    def abort(self) -> None:
        """Hand out nothing more (a load failed)."""
        with self._lock:
            self._at = len(self._ranges)
            self.aborted = True

    #: Set once the load failed: a lane that held a piece (waiting to write it) drops it.
    aborted = False


#: The device each reader thread's CUDA runtime has current (set once per thread, not per load).
_BOUND = threading.local()


def _lane_copy(queue: WorkQueue, ring: PinnedRing, device: int, readers: ThreadPoolExecutor,
               copier: device_copy.Copier, before_writes: BeforeWrites, cold: bool) -> None:
    """Every piece of ``queue`` to the device, through the lanes: each reads into its own buffers
    and queues their copies on its own stream. Returns once every copy is done; on an error, once
    every lane has stopped reading and its copies are done (no lane writes into a buffer, and no
    copy reads one, after the next load owns it), raising the first error. The lanes' shape is a
    warm or a ``cold`` load's (:func:`lane_shape`).
    ``before_writes``: each lane calls it once it has read into every buffer it owns (its reads go
    ahead while, say, the layout probe finishes), before its first device copy, and stops with what
    it raises."""
    shape = ring.last_shape = lane_shape(len(ring.buffers), cold)
    events, streams = ring.tools_for(device, shape.parts)
    views, piece_bytes = ring.views(shape.parts), ring.nbytes // shape.parts
    lanes = min(shape.lanes, len(streams))

    def lane(i: int) -> None:
        own, stream, turn, gate = views[i::lanes], streams[i], 0, before_writes
        owned_events = events[i::lanes]
        held: list[tuple[Piece, torch.Tensor, torch.cuda.Event]] = []  # read while the gate is shut
        if getattr(_BOUND, "device", None) != device:
            copier.bind(device)
            _BOUND.device = device

        def write(piece: Piece, staged: torch.Tensor, event: torch.cuda.Event) -> None:
            copier.copy(piece.dest, staged, stream)
            copier.record(event, stream)

        def release() -> bool:
            """Once the gate opens, what this lane holds written; False: the load failed meanwhile."""
            nonlocal gate
            if gate is not None:
                gate()
                gate = None
            if queue.aborted:
                return False
            for kept in held:
                write(*kept)
            held.clear()
            return True

        try:
            while (piece := queue.take(piece_bytes)) is not None:
                buffer, event = own[turn % len(own)], owned_events[turn % len(own)]
                turn += 1
                copier.wait(event)  # this buffer's last copy is done
                staged = buffer[:piece.dest.numel()]
                read_into(piece.fd, piece.file_offset, staged)
                if gate is None:
                    write(piece, staged, event)
                    continue
                held.append((piece, staged, event))
                if len(held) == len(own) and not release():  # every buffer it owns read ahead first
                    break
            if held and not queue.aborted:  # the queue ran out while this lane read ahead
                release()
        except BaseException:
            queue.abort()  # the other lanes stop at their next piece
            raise
        finally:
            copier.finish(stream)

    running = []
    try:
        for i in range(lanes):
            running.append(readers.submit(lane, i))
        wait(running)
    except BaseException:  # Ctrl-C, say: the lanes end their piece in flight before the ring is given up
        queue.abort()
        wait(running, timeout=60)
        raise
    for future in running:
        if future.exception() is not None:
            raise future.exception()  # type: ignore[misc]


#: One read of a load: ``(fd, file offset, flat uint8 destination)``, the destination's size bytes.
Range = tuple[int, int, torch.Tensor]


def fill_device(ranges: Iterable[Range], device: torch.device, before_writes: BeforeWrites = None) -> None:
    """Every range into its (one ``device``'s) destination through the process's ring; the
    copies are done when it returns. ``before_writes``: called before the first byte lands in a
    destination (the reads start at once): what it raises stops the load with nothing written."""
    queue = WorkQueue(ranges)
    cold = not in_page_cache(queue.ends)  # the load's first or last bytes are not in the page cache
    ring = shared_ring(ring_buffers(cold))  # waits for a ring still being pinned in the background
    readers = shared_readers()
    index = torch.cuda._get_device_index(device, optional=True)
    copier = device_copy.copier(settings.cudart())
    with RING_LOCK:
        _, streams = ring.tools_for(index)  # every lane's stream, warm or cold
        caller_done = torch.cuda.Event()
        caller_done.record(torch.cuda.current_stream(index))
        for stream in streams:
            stream.wait_event(caller_done)  # after the caller's work (the destinations' memory may be reused)
        _lane_copy(queue, ring, index, readers, copier, before_writes, cold)
