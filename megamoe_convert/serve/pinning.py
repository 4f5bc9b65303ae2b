"""Page-locked host memory by registration (``MEGAMOE_FAST_PIN=1``): one anonymous mapping backed by
transparent huge pages, cut into buffers that several threads fault in and register with CUDA
(``cudaHostRegister``) at once; faster than ``torch``'s allocator for one process alone on some
hosts, slower where every rank of a node pins at once (``benchmarks/bench_pin.py``).

Apart from :mod:`.staging`, whose pinned ring is made of these buffers, because this is the one part of
the GPU path that talks to the kernel's memory and CUDA's registration rather than moving a load's bytes;
where registering fails, the ring falls back to ``torch``'s pinned allocator.
"""

from __future__ import annotations

import mmap
import threading

import torch

_HUGE_PAGE = 2 << 20
_PIN_THREADS = 8


def huge_page_block(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """``nbytes`` of anonymous memory aligned to a huge page, asking the kernel for huge pages
    (fewer pages to fault in and lock). Returns the tensor and the mapping that owns it."""
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # transparent huge pages off: ordinary pages, still registered in parallel
            pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start:start + nbytes], mapping


def register(buffers: list[torch.Tensor]) -> bool:
    """Fault in and page-lock every buffer, several at once. Runs in its own threads, so a failed
    registration's CUDA error stays in them (CUDA's last error is per thread), never reaching the
    engine's. False if any buffer could not be registered (those that were are released)."""
    cudart = torch.cuda.cudart()
    pinned = [False] * len(buffers)

    def pin(first: int) -> None:
        for i in range(first, len(buffers), _PIN_THREADS):
            buffers[i].fill_(0)  # fault the pages in here, in parallel, not one by one inside the driver
            pinned[i] = int(cudart.cudaHostRegister(buffers[i].data_ptr(), buffers[i].numel(), 0)) == 0

    # Plain threads, joined here: they finish even while the interpreter is shutting down.
    threads = [threading.Thread(target=pin, args=(i,), name="megamoe-pin") for i in range(_PIN_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if all(pinned):
        return True
    for buffer, ok in zip(buffers, pinned, strict=True):
        if ok:
            cudart.cudaHostUnregister(buffer.data_ptr())
    return False
