#!/usr/bin/env python3
"""What pinning the staging ring costs a rank's start, every rank process of a node at once.

Each rank process (one per GPU, all started together, a fresh process per measurement) times, from
its CUDA context on: a model-build-like loop (parameters allocated on its GPU, layer by layer, as an
engine builds its model) while the staging ring is pinned on a thread as the loaders start it
(``staging.prepare_gpu_staging``), then one load of its file through the ring
(``staging.fill_device``), warm (the file in the page cache) or cold (the page cache dropped first).
Per pinning (``fast``: huge pages registered with CUDA by several threads;
``torch``: torch's pinned allocator; ``MEGAMOE_FAST_PIN``) and ring size (16 MB buffers), and for
reference no ring at all (``pageable``: the file read into ordinary memory and copied to the GPU).
The build's time against ``pageable``'s is what the pinning costs the engine's model build; the
load's is what the ring gives back. Every load's bytes are checked against the file.

    python3 benchmarks/bench_pin.py --work /tmp/pin --save pin.json          # a GPU machine, every GPU
    python3 benchmarks/bench_pin.py --smoke --work /tmp/x --save x.json      # CPU: the machinery, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common import drop_page_cache, node_machine  # noqa: E402

#: The measured ways to the GPU: pinning[:ring buffers, warm or cold] (no count: the engines' own
#: ring, sized by the load's file: its size and whether it is in the page cache); ``pageable``: no ring.
MODES = ("torch", "torch:32", "torch:16", "torch:8", "pageable")
#: The build-like loop: layers x parameters of 1-48 MB each (as an MoE model's, in size and number).
LAYERS, PARAMETERS = 12, 24
PIECE = 256 << 20  # the load's ranges, as an engine's large expert tensors


def child(mode: str, path: str, device_name: str) -> dict[str, Any]:
    """One rank process: the build beside the ring's pinning, then the load; its report."""
    import torch

    device = torch.device(device_name)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context, before the clock (the engine made it earlier)
    method, _, count = mode.partition(":")
    ringed = method != "pageable"
    from megamoe_convert.serve import staging

    if ringed:
        os.environ["MEGAMOE_FAST_PIN"] = "1" if method == "fast" else "0"
    if count:
        staging.ring_buffers = lambda cold=False: int(count)  # one size, warm or cold
    else:  # the ring sized as for a conversion of the file's size, by whether it is in the page cache
        from megamoe_convert.serve.residency import file_cached

        staging.conversion_load = lambda file: (file_cached(file), os.path.getsize(file))
    start = time.perf_counter()
    if ringed:
        staging.prepare_gpu_staging(path)
    held = [torch.empty((1 + (i * 7919 + layer) % 48) << 20, dtype=torch.uint8, device=device)
            for layer in range(LAYERS) for i in range(PARAMETERS)]
    _sync(device)
    built = time.perf_counter()
    size = os.path.getsize(path)
    dest = torch.empty(size, dtype=torch.uint8, device=device)
    if ringed:
        fd = os.open(path, os.O_RDONLY)
        try:
            staging.fill_device([(fd, o, dest[o:o + PIECE]) for o in range(0, size, PIECE)], device)
        finally:
            os.close(fd)
    else:
        dest.copy_(torch.from_file(path, shared=False, size=size, dtype=torch.uint8))
    _sync(device)
    loaded = time.perf_counter()
    ring = staging._RING
    return {"mode": mode, "build_s": built - start, "load_s": loaded - built, "total_s": loaded - start,
            "pin_s": ring.pin_seconds if ring is not None else 0.0, "ring_buffers": len(ring.buffers) if ring else 0,
            "parameters": len(held),
            "bytes_ok": _same_bytes(dest, path, size)}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _same_bytes(dest: Any, path: str, size: int) -> bool:
    """The load's first and last 1 MB against the file's."""
    import torch

    whole = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    edge = min(size, 1 << 20)
    return bool(dest[:edge].cpu().equal(whole[:edge]) and dest[-edge:].cpu().equal(whole[-edge:]))


def load_file(work: Path, rank: int, nbytes: int) -> Path:
    """The rank's file of ``nbytes`` (distinct bytes), written once."""
    path = work / f"load-{rank}.bin"
    if not path.exists() or path.stat().st_size != nbytes:
        import numpy as np

        words = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(rank)
        tmp = path.with_suffix(".tmp")
        words.tofile(tmp)
        tmp.replace(path)
    return path


def measure(mode: str, files: list[Path], gpus: int, threads: int, cache: str) -> dict[str, Any]:
    """Every rank process of the node started at once for ``mode``; their reports. ``cold``: the
    page cache dropped first (needs root), ``warm``: every file read into it first."""
    if cache == "cold" and not drop_page_cache():
        return {"mode": mode, "cache": cache, "failed": "could not drop the page cache (needs root)"}
    if cache == "warm":
        from bench_startup import warm

        warm(files)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, str(f),
                               f"cuda:{rank % gpus}" if gpus else "cpu"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank, f in enumerate(files)]
    ended = [(proc, *proc.communicate()) for proc in procs]  # every rank waited for, whichever fails
    for proc, _, err in ended:
        if proc.returncode != 0:
            return {"mode": mode, "cache": cache, "failed": (err.strip().splitlines() or ["no output"])[-1][:200]}
    return {"mode": mode, "cache": cache, "ranks": [{"rank": rank, **json.loads(out.strip().splitlines()[-1])}
                                    for rank, (_, out, _) in enumerate(ended)]}


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and cache, the medians over ranks and rounds, and the build over ``pageable``'s."""
    out = []
    for mode, cache in dict.fromkeys((r["mode"], r.get("cache", "warm")) for r in rows):
        runs = [r for r in rows if r["mode"] == mode and r.get("cache", "warm") == cache and "ranks" in r]
        if runs:
            ranks = [x for r in runs for x in r["ranks"]]
            got = {k: statistics.median(x[k] for x in ranks) for k in ("build_s", "pin_s", "load_s", "total_s")}
            got["slowest_total_s"] = statistics.median(max(x["total_s"] for x in r["ranks"]) for r in runs)
            got["ring_buffers"] = max(x.get("ring_buffers", int(mode.partition(":")[2] or 0)) for x in ranks)
            out.append({"mode": mode, "cache": cache, **got})
    for got in out:
        pageable = [p for p in out if p["mode"] == "pageable" and p["cache"] == got["cache"]]
        if pageable:
            got["build_over_pageable_s"] = got["build_s"] - pageable[0]["build_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="folder for the ranks' load files")
    parser.add_argument("--n", type=int, default=None, help="rank processes (default: one per GPU)")
    parser.add_argument("--load-gib", type=float, default=1.7, help="each rank's warm load, GiB (default: 1.7, about a "
                        "rank's experts of DeepSeek-V4-Flash's dims at 2 MoE layers, EP 4)")
    parser.add_argument("--modes", default=",".join(MODES), help="pinning:ring buffers, or pageable")
    parser.add_argument("--caches", default="warm", help="warm, cold (drops the page cache: root), or both: warm,cold")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the modes' order reversed in odd ones")
    parser.add_argument("--save", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU: two processes, 8 MB, pageable only")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    modes = args.modes.split(",")
    if args.smoke or not gpus:
        gpus, modes, args.load_gib, args.n, args.rounds = 0, ["pageable"], 8 / 1024, args.n or 2, 1
    n = args.n or gpus
    threads = max(1, (os.cpu_count() or 1) // n)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    files = [load_file(work, rank, int(args.load_gib * (1 << 30)) // 4096 * 4096) for rank in range(n)]
    rows = []
    caches = args.caches.split(",")
    for rnd in range(args.rounds):
        for mode, cache in [(m, c) for c in caches for m in (modes if rnd % 2 == 0 else modes[::-1])]:
            row = {**measure(mode, files, gpus, threads, cache), "round": rnd}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "ranks"}
                             | ({"total_s": [round(x["total_s"], 3) for x in row["ranks"]]} if "ranks" in row else {})),
                  flush=True)

    result = {"benchmark": "pin", "machine": node_machine(n, threads, gpus), "load_bytes": files[0].stat().st_size,
              "modes": modes, "caches": caches, "smoke": bool(args.smoke or not gpus), "rows": rows,
              "summary": summary(rows)}
    Path(args.save).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:5])))
    else:
        main()
