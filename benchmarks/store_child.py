"""``bench_store.py``'s child: one measurement in a fresh process (``bench_store.py --child KIND``):
the rank's destination tensors allocated on the device as an engine's model build does, then one
form filling them (the store's ``load_slots``, the per-rank form's ``load_rank``) or one ceiling
(``host_read`` / ``disk_read``: the rank's store ranges into pinned buffers; ``h2d_pinned``), or
``check``: both forms' bytes compared. Its report is the one JSON line the script prints for the parent."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from common import drop_page_cache  # the benchmarks' one way to go cold


def destinations(store_dir: Path, ep_size: int, rank: int, device: str) -> tuple[dict, dict, int]:
    """The rank's destination tensors by layer (shapes from the store's dims), its slots, and its bytes."""
    import torch

    from megamoe_convert.layout.placement import Placement
    from megamoe_convert.serve import store
    from megamoe_convert.serve.loader import open_converted
    from megamoe_convert.source import formats

    converted = open_converted(store_dir)
    manifest = converted.manifest
    dests, slots = {}, {}
    for layer in manifest.layers:
        ids = Placement.default(manifest.dims.experts_of(layer), ep_size).rank_logical_ids(rank)
        slots[layer] = ids
        dests[layer] = {key: torch.empty(spec.shape, dtype=formats.torch_dtype(spec.dtype), device=device)
                        for key, spec in store.slot_specs(manifest, layer, len(ids)).items()}
    nbytes = sum(t.numel() * t.element_size() for d in dests.values() for t in d.values())
    return dests, slots, nbytes


def store_ranges(store_dir: Path, ep_size: int, rank: int) -> list[tuple[Path, int, int]]:
    """``(file, offset, nbytes)`` of every range the rank reads from the store (default placement)."""
    from megamoe_convert.layout.placement import Placement
    from megamoe_convert.serve import store
    from megamoe_convert.serve.loader import open_converted

    converted = open_converted(store_dir)
    manifest = converted.manifest
    ranges = []
    for layer in manifest.layers:
        ids = Placement.default(manifest.dims.experts_of(layer), ep_size).rank_logical_ids(rank)
        path = store_dir / manifest.expert_file(layer)
        ranges += [(path, r.file_offset, r.nbytes) for r in store.rank_read_plan(manifest, layer, ids)]
    return ranges


def host_read(ranges: list[tuple[Path, int, int]], threads: int, piece: int, pinned: bool) -> float:
    """Seconds to read ``ranges`` into ``threads`` (pinned) buffers of ``piece`` bytes, ``threads`` at
    once: the loader's own pieces (its work queue), with no device copy.
    The threads are started before the clock, as the loader's are."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from megamoe_convert.serve.staging import WorkQueue
    from megamoe_convert.source.safetensors_io import read_into

    buffers = [torch.empty(piece, dtype=torch.uint8, pin_memory=pinned) for _ in range(threads)]
    fds = {path: os.open(path, os.O_RDONLY) for path, _, _ in ranges}
    # Destinations only for their sizes: the pieces' bytes stay in the buffers.
    queue = WorkQueue([(fds[path], off, torch.empty(n, dtype=torch.uint8, device="meta")) for path, off, n in ranges])

    def read(i: int) -> None:
        while (p := queue.take(piece)) is not None:
            read_into(p.fd, p.file_offset, buffers[i][:p.dest.numel()])

    with ThreadPoolExecutor(threads) as pool:
        everyone = threading.Barrier(threads)
        list(pool.map(lambda _: everyone.wait(timeout=10), range(threads)))
        t0 = time.perf_counter()
        list(pool.map(read, range(threads)))
        seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return seconds


def child(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    import torch

    from megamoe_convert.serve import staging, store
    from megamoe_convert.serve.loader import load_rank, open_converted

    imported = time.perf_counter() - started
    device = torch.device(args.device)
    preparing = None
    if args.staging != "none" and device.type == "cuda":
        torch.cuda.init()
        # as the engines do as they build the model
        preparing = staging.prepare_gpu_staging(args.store if args.child == "store" else args.per_rank)
    dests, slots, nbytes = destinations(Path(args.store), args.ep, args.rank, args.device)
    if args.staging == "ready" and preparing is not None:
        preparing.join()  # a model build long enough to hide all of it (a real model's is seconds)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    if args.child == "store":
        t0 = time.perf_counter()
        store.load_slots(open_converted(args.store), slots, into=dests)
    elif args.child == "per_rank":
        t0 = time.perf_counter()
        load_rank(args.per_rank, args.rank, into={layer.prefix: d for layer, d in dests.items()})
    elif args.child == "h2d_pinned":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        t0 = time.perf_counter()
        flat.copy_(host, non_blocking=True)
    elif args.child in ("host_read", "disk_read"):  # the rank's store ranges, best of the reader shapes
        ranges = store_ranges(Path(args.store), args.ep, args.rank)
        cold = staging.lane_shape(staging.ring_buffers(cold=True), cold=True)  # the loader's own cold shape
        shapes = [(staging.read_threads(), staging.RING_BUFFER_BYTES)] if args.child == "host_read" \
            else [(staging.read_threads(), staging.RING_BUFFER_BYTES),
                  (cold.lanes, staging.RING_BUFFER_BYTES // cold.parts),
                  (64, 4 << 20)]
        best = {}
        for threads, piece in shapes:
            if args.child == "disk_read" and best and not drop_page_cache():
                break
            seconds = host_read(ranges, threads, piece, pinned=device.type == "cuda")
            if not best or seconds < best["seconds"]:
                best = {"seconds": seconds, "threads": threads, "piece_mb": piece >> 20}
        return {**best, "bytes": nbytes, "gb_per_s": nbytes / best["seconds"] / 1e9}
    elif args.child == "check":
        other = {layer: {k: torch.empty_like(t) for k, t in d.items()} for layer, d in dests.items()}
        store.load_slots(open_converted(args.store), slots, into=dests)
        load_rank(args.per_rank, args.rank, into={layer.prefix: d for layer, d in other.items()})
        same = all(torch.equal(dests[layer][k], other[layer][k]) for layer in dests for k in dests[layer])
        return {"same": same, "bytes": nbytes}
    else:
        raise SystemExit(f"unknown child {args.child}")
    sync()
    seconds = time.perf_counter() - t0
    report = {"seconds": seconds, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9, "import_s": imported}
    ring = staging._RING
    if ring is not None and device.type == "cuda":  # how long pinning took, and how much of it the call waited
        report.update(pin_s=ring.pin_seconds, waited_for_ring_s=max(0.0, ring.ready_at - t0))
        if ring.last_shape is not None:  # the lanes of a warm or a cold load (staging.lane_shape)
            report.update(lanes=ring.last_shape.lanes, parts=ring.last_shape.parts)
    return report
