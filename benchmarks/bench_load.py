#!/usr/bin/env python3
"""Load at the host-to-device limit? One EP rank of a converted checkpoint, beside the baseline.

For each checkpoint size (real DeepSeek-V4 expert dims from a preset; fewer layers; the
vocabulary cut, since only experts are timed) this synthesises the checkpoint, converts the
benchmarked rank (``--experts-only``), then times in one process, on one GPU:

  baseline   the vLLM-style path: every source shard read the way vLLM's
             ``safetensors_weights_iterator`` does (``safe_open(framework="pt")``, every
             tensor of every file, in file order); the rank's experts kept and copied into
             per-layer GPU parameters (w1/w3 stacked as w13, UE8M0 scales widened to fp32,
             as vLLM's weight loader stores them); then, per layer, the transform on the GPU
             (``megamoe_convert.layout`` standing in for DeepGEMM's, after narrowing the
             scales back to bytes, as DeepGEMM's SM100 path does);
  load_rank  ``megamoe_convert.loader.load_rank(out, rank, device="cuda")``;
  h2d_pinned the raw limit: one pinned host buffer of the rank's bytes copied to the GPU
             (also ``h2d_pageable``, the same from ordinary memory);
  safetensors ``safetensors.safe_open(device="cuda")`` of the rank's converted shard files;
  fastsafetensors ``fastsafe_open(..., device="cuda", nogds=True)`` of the same files, if
             importable (a GPU host without network access needs its wheel carried in);
  host_read  the host side alone: the rank's files read from the page cache into pinned
             buffers with load_rank's thread count and piece size, no device copy.

Warm: the files are in the page cache (``--repeats`` runs each, median). Cold: the page
cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``, needs root) before each of
``--cold-repeats`` runs; where that is refused the cold rows say so. Bytes read from the
storage device come from ``/proc/self/io`` (``read_bytes``) around each cold run.
Correctness is checked once per size: ``load_rank``'s tensors equal the baseline's
(values, shapes, strides). The last line printed is JSON (``--save FILE`` writes it too).
The paths themselves are ``load_paths.py``'s; this script runs and times them.

    PYTHONPATH=. python3 benchmarks/bench_load.py                 # on a GPU machine
    PYTHONPATH=. python3 benchmarks/bench_load.py --device cpu --quick   # a small run, no GPU
    PYTHONPATH=. python3 benchmarks/bench_load.py --smoke --workdir /tmp/x   # seconds, no GPU (CI runs it)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from common import bench_config, drop_page_cache, emit_summary, synth_checkpoint  # noqa: E402
from load_paths import (  # noqa: E402
    H2D,
    HostRead,
    PipeCopy,  # noqa: F401  (node_forms.py takes it from here, beside HostRead)
    baseline_vllm,
    equal_layers,
    fastsafetensors_open,
    free_device,
    io_read_bytes,
    ours,
    rank_files,
    safetensors_open,
)

# --------------------------------------------------------------------------------------
# One size
# --------------------------------------------------------------------------------------

def measure_size(src: Path, out: Path, args: argparse.Namespace, device: torch.device, log: Callable[[str], None],
                 ) -> dict[str, Any]:
    rank, ep = args.rank, args.ep_size
    files = rank_files(out, rank)
    rank_bytes = sum(p.stat().st_size for p in files)
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    methods: dict[str, Callable[[], Any]] = {
        "baseline": lambda: baseline_vllm(src, rank, ep, device),
        "load_rank": lambda: ours(out, rank, device),
        "safetensors": lambda: safetensors_open(files, device),
    }
    notes: dict[str, str] = {}
    if device.type == "cuda":
        try:
            import fastsafetensors  # noqa: F401

            methods["fastsafetensors"] = lambda: fastsafetensors_open(files, device, nogds=True)
        except Exception as e:  # noqa: BLE001
            notes["fastsafetensors"] = f"not importable here ({type(e).__name__}: {e}); the device has no network"
        h2d = H2D(rank_bytes, device)
        methods["h2d_pinned"] = h2d.pinned_copy
        methods["h2d_pageable"] = h2d.pageable_copy
        from megamoe_convert.serve import staging

        host_read = HostRead(files, staging.read_threads(), staging.RING_BUFFER_BYTES)
        methods["host_read"] = host_read.run

    # Correctness first (and warm-up: CUDA context, kernels, pinned allocator, page cache).
    want, baseline_bytes_read = baseline_vllm(src, rank, ep, device)
    start = time.perf_counter()
    got = ours(out, rank, device)
    first_load_s = time.perf_counter() - start  # this process's first load_rank: pinned ring allocated
    correct = equal_layers(want, got)
    del want, got
    free_device(device)
    log(f"  load_rank == baseline transform: {correct}")
    for name, run in methods.items():
        if name in ("baseline", "load_rank"):
            continue
        try:
            run()
        except Exception as e:  # noqa: BLE001
            notes[name] = f"failed: {type(e).__name__}: {e}"
            log(f"  {name}: {notes[name]}")
        free_device(device)
    for name in list(notes):
        methods.pop(name, None)

    warm: dict[str, list[float]] = {name: [] for name in methods}
    for repeat in range(args.repeats):
        for name in (list(methods) if repeat % 2 == 0 else list(methods)[::-1]):
            start = time.perf_counter()
            result = methods[name]()
            warm[name].append(time.perf_counter() - start)
            del result
            free_device(device)

    cold: dict[str, Any] = {}
    cold_possible = args.cold_repeats > 0 and drop_page_cache()
    if args.cold_repeats > 0 and not cold_possible:
        notes["cold"] = "the page cache could not be dropped here (not root?): no cold numbers"
    if cold_possible:
        for name in methods:
            if name.startswith("h2d"):
                continue  # host memory to GPU: no file, no cache
            times, reads = [], []
            for _ in range(args.cold_repeats):
                drop_page_cache()
                before = io_read_bytes()
                start = time.perf_counter()
                result = methods[name]()
                times.append(time.perf_counter() - start)
                after = io_read_bytes()
                reads.append(after - before if before is not None and after is not None else None)
                del result
                free_device(device)
            cold[name] = {"s": round(statistics.median(times), 4), "runs": [round(t, 4) for t in times],
                          "read_bytes": reads[0], "gb_per_s": round(rank_bytes / statistics.median(times) / 1e9, 2)}

    def row(name: str) -> dict[str, Any]:
        s = statistics.median(warm[name])
        return {"s": round(s, 4), "gb_per_s": round(rank_bytes / s / 1e9, 2), "runs": [round(t, 4) for t in warm[name]]}

    result: dict[str, Any] = {
        "rank": rank, "ep_size": ep, "rank_bytes": rank_bytes, "first_load_rank_s": round(first_load_s, 4),
        "source_bytes": source_bytes, "baseline_bytes_read": baseline_bytes_read, "correct": correct,
        "warm": {name: row(name) for name in methods}, "cold": cold, "notes": notes,
    }
    w = result["warm"]
    if "h2d_pinned" in w:
        result["load_vs_pinned_h2d"] = round(w["h2d_pinned"]["s"] / w["load_rank"]["s"], 3)
    result["speedup_vs_baseline"] = round(w["baseline"]["s"] / w["load_rank"]["s"], 2)
    if "baseline" in cold and "load_rank" in cold:
        result["cold_speedup_vs_baseline"] = round(cold["baseline"]["s"] / cold["load_rank"]["s"], 2)
    return result


def _staging_of(threads: int, count: int, nbytes: int) -> None:
    """Replace the process's staging (ring, readers, lanes) with one of this shape: the loader
    makes its own once per process, from ``MEGAMOE_READ_THREADS``; only this sweep reshapes it."""
    from concurrent.futures import ThreadPoolExecutor

    from megamoe_convert import settings
    from megamoe_convert.serve import staging

    with staging.RING_LOCK:
        if staging._READERS is not None:
            staging._READERS.shutdown()
        os.environ[settings.READ_THREADS] = str(threads)  # the lanes of each load, read as it starts
        staging._RING = staging.PinnedRing(count, nbytes)  # the old ring's memory stays pinned
        staging._READERS = ThreadPoolExecutor(staging.reader_count(), thread_name_prefix="megamoe-read")


def loader_sweep(out: Path, rank: int, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """Warm ``load_rank`` under other read-thread counts and pinned-ring sizes (then the defaults again)."""
    from megamoe_convert import settings
    from megamoe_convert.serve import staging

    defaults = (staging.read_threads(), staging.ring_buffers(), staging.RING_BUFFER_BYTES)
    setting = os.environ.get(settings.READ_THREADS)  # put back as it was once the sweep is done
    rows = []
    try:
        for threads, count, mb in ((4, 6, 32), (6, 12, 32), (8, 12, 32), (8, 16, 32), (8, 8, 64), (12, 16, 32),
                                   (12, 24, 32), (16, 24, 16), (16, 32, 32), (24, 32, 16)):
            _staging_of(threads, count, mb << 20)
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                result = ours(out, rank, device)
                times.append(time.perf_counter() - start)
                del result
                free_device(device)
            rows.append({"read_threads": threads, "ring_buffers": count, "ring_mb": mb,
                         "s": round(statistics.median(times[1:]), 4), "first_s": round(times[0], 4),
                         "pin_s": round(staging._RING.pin_seconds, 4)})  # pinned before the first call
    finally:
        _staging_of(*defaults)
        os.environ.pop(settings.READ_THREADS)
        if setting is not None:
            os.environ[settings.READ_THREADS] = setting
    return rows


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small size, fewer repeats")
    p.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU, one repeat: seconds (CI runs it)")
    p.add_argument("--preset", default="flash")
    p.add_argument("--layers", default="1,2,4", help="MoE layers of each size (decoder layers; no MTP)")
    p.add_argument("--experts", type=int, default=256, help="routed experts per layer (Flash: 256)")
    p.add_argument("--vocab", type=int, default=1280)
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cold-repeats", type=int, default=1)
    p.add_argument("--sweep", action="store_true", help="also time load_rank under other thread/ring settings")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workdir", default=os.environ.get("MEGAMOE_BENCH_DIR", "/tmp/megamoe-bench-load"))
    p.add_argument("--keep", action="store_true", help="keep checkpoints and conversions")
    p.add_argument("--save", help="also write the final JSON to this file")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.experts, args.repeats = "1", min(args.experts, 64), min(args.repeats, 2)
    if args.smoke:
        args.preset, args.layers, args.experts, args.ep_size, args.repeats = "tiny", "1", 8, 2, 1
        args.cold_repeats, args.device = 0, "cpu"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu for a smoke test)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda:0": every library takes that form
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    workdir = Path(args.workdir)
    sizes = [int(x) for x in args.layers.split(",")]
    jobs = {layers: (workdir / f"src-{args.preset}-L{layers}-E{args.experts}",
                     bench_config(args.preset, layers, args.experts, 0, args.vocab)) for layers in sizes}
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        synth_s = dict(zip(jobs, pool.map(synth_checkpoint, [str(p) for p, _ in jobs.values()],
                                          [c for _, c in jobs.values()]), strict=True))
    log(f"synthesised {len(jobs)} checkpoints ({', '.join(f'{s:.0f}s' for s in synth_s.values())})")

    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert

    results = []
    for layers in sizes:
        src = jobs[layers][0]
        out = workdir / f"out-{src.name}-ep{args.ep_size}-r{args.rank}"
        start = time.perf_counter()
        summary = convert(src, out, ConvertOptions(ep_size=args.ep_size, ranks=str(args.rank), experts_only=True,
                                                   fsync=False, workers=min(8, os.cpu_count() or 1)))
        convert_s = time.perf_counter() - start
        log(f"L{layers}: converted rank {args.rank} ({summary.bytes_written / 1e9:.2f} GB) in {convert_s:.1f}s; "
            "measuring")
        r = measure_size(src, out, args, device, log)
        r.update(layers=layers, experts=args.experts, synth_s=round(synth_s[layers], 1),
                 convert_rank_s=round(convert_s, 2))
        if args.sweep and layers == sizes[-1]:
            r["loader_sweep"] = loader_sweep(out, args.rank, device, args.repeats)
        results.append(r)
        w = r["warm"]
        log(f"L{layers}: rank {r['rank_bytes'] / 1e9:.2f} GB of {r['source_bytes'] / 1e9:.2f} GB | warm s: "
            + " ".join(f"{k} {v['s']:.3f} ({v['gb_per_s']} GB/s)" for k, v in w.items())
            + (" | cold s: " + " ".join(f"{k} {v['s']:.3f}" for k, v in r["cold"].items()) if r["cold"] else ""))
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        for src, _ in jobs.values():
            shutil.rmtree(src, ignore_errors=True)

    largest = results[-1]
    summary = {
        "benchmark": "load", "tag": args.tag, "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                                           else platform.processor() or "cpu"),
        "preset": args.preset, "ep_size": args.ep_size, "rank": args.rank,
        "rank_bytes": largest["rank_bytes"], "source_bytes": largest["source_bytes"],
        "load_s": largest["warm"]["load_rank"]["s"], "load_gb_per_s": largest["warm"]["load_rank"]["gb_per_s"],
        "baseline_s": largest["warm"]["baseline"]["s"],
        "speedup_vs_baseline": largest["speedup_vs_baseline"],
        "load_vs_pinned_h2d": largest.get("load_vs_pinned_h2d"),
        "bytes_read_fraction": round(largest["rank_bytes"] / largest["baseline_bytes_read"], 4),
        "all_correct": all(r["correct"] for r in results),
        "sizes": results,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "platform": platform.platform()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    emit_summary(summary, args.save)
    return summary


if __name__ == "__main__":
    main()
