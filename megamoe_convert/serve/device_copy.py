"""Host-to-device copies issued from the staging's reader threads, without holding the GIL.

Each reader copies its own buffers to the device right after reading them (:mod:`.staging`). A
copy issued through ``torch`` (``Tensor.copy_``, ``Event.record``) holds the GIL while the CUDA
runtime takes its locks, so many readers issuing copies stall one another's Python: the lanes
then ran no faster than one thread issuing every copy. The CUDA runtime's own entry points called
through ``ctypes`` release the GIL for the call, and the lanes keep up with the page cache ->
pinned read alone (measurements: ``docs/benchmarks.md``).

The runtime is the one ``torch`` loaded (found in the process's mappings), so its streams,
events and primary context are the ones ``torch`` uses; where none can be found (a static
build) or ``MEGAMOE_CUDART=0``, the same calls go through ``torch``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Protocol

import torch

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


class Copier(Protocol):
    """What a reader lane needs to move its buffers to the device."""

    def bind(self, device: int) -> None:
        """Make ``device`` current in the calling thread (its copies' streams are on it)."""

    def copy(self, dest: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Queue ``src`` (pinned, flat uint8) -> ``dest`` (device, same size) on ``stream``."""

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None: ...

    def wait(self, event: torch.cuda.Event) -> None:
        """Block the calling thread until ``event`` has happened."""

    def finish(self, stream: torch.cuda.Stream) -> None:
        """Block the calling thread until everything queued on ``stream`` is done."""


class TorchCopier:
    """The copies through ``torch`` (holding the GIL in the runtime's calls)."""

    def bind(self, device: int) -> None:
        torch.cuda.set_device(device)

    def copy(self, dest: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            dest.copy_(src, non_blocking=True)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def finish(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()


class CudartCopier:
    """The copies through the CUDA runtime's C entry points (``ctypes`` releases the GIL)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        handle, size = ctypes.c_void_p, ctypes.c_size_t
        self._rt = library
        self._signature("cudaSetDevice", ctypes.c_int)
        self._signature("cudaMemcpyAsync", handle, handle, size, ctypes.c_int, handle)
        self._signature("cudaEventRecord", handle, handle)
        self._signature("cudaEventSynchronize", handle)
        self._signature("cudaStreamSynchronize", handle)
        library.cudaGetErrorString.argtypes, library.cudaGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p

    def _signature(self, name: str, *argtypes: type) -> None:
        function = getattr(self._rt, name)
        function.argtypes, function.restype = list(argtypes), ctypes.c_int

    def _check(self, name: str, status: int) -> None:
        if status != 0:
            what = self._rt.cudaGetErrorString(status) or b"unknown error"
            raise RuntimeError(f"{name} failed: {what.decode(errors='replace')} (CUDA error {status})")

    def bind(self, device: int) -> None:
        self._check("cudaSetDevice", self._rt.cudaSetDevice(device))

    def copy(self, dest: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        self._check("cudaMemcpyAsync", self._rt.cudaMemcpyAsync(
            dest.data_ptr(), src.data_ptr(), src.numel(), _HOST_TO_DEVICE, stream.cuda_stream))

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        self._check("cudaEventRecord", self._rt.cudaEventRecord(event.cuda_event, stream.cuda_stream))

    def wait(self, event: torch.cuda.Event) -> None:
        self._check("cudaEventSynchronize", self._rt.cudaEventSynchronize(event.cuda_event))

    def finish(self, stream: torch.cuda.Stream) -> None:
        self._check("cudaStreamSynchronize", self._rt.cudaStreamSynchronize(stream.cuda_stream))


def loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process has loaded (``torch``'s), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


_COPIER: Copier | None = None
_LOCK = threading.Lock()


def copier(use_cudart: bool = True) -> Copier:
    """The process's copier: the CUDA runtime's entry points where ``torch``'s runtime is found
    (and ``use_cudart``), else ``torch``. Chosen once, after CUDA is initialized."""
    global _COPIER
    with _LOCK:
        if _COPIER is None:
            library = loaded_cudart() if use_cudart else None
            _COPIER = CudartCopier(library) if library is not None else TorchCopier()
        return _COPIER


def reset() -> None:
    """Choose the copier again on next use (a test of both copiers in one process)."""
    global _COPIER
    with _LOCK:
        _COPIER = None
