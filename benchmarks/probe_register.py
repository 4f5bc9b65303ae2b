#!/usr/bin/env python3
"""Probe: can the GPU copy straight out of the page cache (cudaHostRegister of a file mmap)?

load_rank's ring path copies page cache -> pinned buffer on CPU cores, then DMAs; host memory
copy bandwidth caps it well under PCIe. Registering the mmap'd file read-only pins the page
cache pages themselves, so the DMA engine reads them with no CPU copy. This times, for one
converted rank: the ring path (load_rank), whole-file registration, and chunked registration
on T threads overlapped with the copies, warm and cold.

    PYTHONPATH=. python3 benchmarks/probe_register.py
    PYTHONPATH=. python3 benchmarks/probe_register.py --smoke --workdir /tmp/x   # tiny; set-up only without a GPU
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import rank_files  # noqa: E402
from common import bench_config, drop_page_cache, synth_checkpoint  # noqa: E402

READ_ONLY = 8  # cudaHostRegisterReadOnly


def check(err: object, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"{what}: cuda error {int(err)}")


def map_file(path: Path) -> tuple[mmap.mmap, torch.Tensor]:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def whole_files(files: list[Path], dests: list[torch.Tensor], stream: torch.cuda.Stream, flags: int) -> dict:
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    maps = [map_file(p) for p in files]
    reg = 0.0
    for (_, host), dest in zip(maps, dests, strict=True):
        s = time.perf_counter()
        check(cudart.cudaHostRegister(host.data_ptr(), host.numel(), flags), "register")
        reg += time.perf_counter() - s
        with torch.cuda.stream(stream):
            dest.copy_(host, non_blocking=True)
    stream.synchronize()
    t_copy = time.perf_counter()
    for _, host in maps:
        check(cudart.cudaHostUnregister(host.data_ptr()), "unregister")
    t_end = time.perf_counter()
    return {"s": t_end - t0, "register_s": reg, "unregister_s": t_end - t_copy}


def chunked(files: list[Path], dests: list[torch.Tensor], stream: torch.cuda.Stream, chunk: int, threads: int,
            willneed: bool) -> dict:
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    maps = [map_file(p) for p in files]
    if willneed:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            os.close(fd)
    jobs = [(host, dest, start, min(chunk, host.numel() - start))
            for (_, host), dest in zip(maps, dests, strict=True) for start in range(0, host.numel(), chunk)]

    def register(job):
        host, _, start, n = job
        check(cudart.cudaHostRegister(host.data_ptr() + start, n, READ_ONLY), "register")
        return job

    with ThreadPoolExecutor(threads) as pool:
        for host, dest, start, n in pool.map(register, jobs):
            with torch.cuda.stream(stream):
                dest[start:start + n].copy_(host[start:start + n], non_blocking=True)
        stream.synchronize()
        t_copy = time.perf_counter()
        list(pool.map(lambda j: check(cudart.cudaHostUnregister(j[0].data_ptr() + j[2]), "unregister"), jobs))
    t_end = time.perf_counter()
    return {"s": t_end - t0, "unregister_s": t_end - t_copy}


def main(argv: list[str] | None = None) -> None:
    import argparse

    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert
    from megamoe_convert.serve.loader import load_rank

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/probe")
    p.add_argument("--smoke", action="store_true", help="a tiny rank; without a GPU, only the set-up runs "
                                                       "(the probe itself is cudaHostRegister): seconds")
    args = p.parse_args(argv)
    work = Path(args.workdir)
    src = work / "src"
    ep = 2 if args.smoke else 8
    config = bench_config("tiny", 1, 8, 0, 1280) if args.smoke else bench_config("flash", 4, 256, 0, 1280)
    synth_checkpoint(str(src), config)
    out = work / "out"
    if not (out / "manifest.json").exists():
        convert(src, out, ConvertOptions(ep_size=ep, ranks="0", experts_only=True, fsync=False, workers=8))
    files = rank_files(out, 0)
    nbytes = sum(p.stat().st_size for p in files)
    if not torch.cuda.is_available():
        if not args.smoke:
            raise SystemExit("probe_register: needs a CUDA GPU (cudaHostRegister); --smoke runs the set-up only")
        print(f"smoke: {len(files)} files, {nbytes} bytes of rank 0 ready; no CUDA GPU, so the registration probe "
              "itself did not run", flush=True)
        return
    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device)
    dests = [torch.empty(p.stat().st_size, dtype=torch.uint8, device=device) for p in files]
    print(f"{len(files)} files, {nbytes / 1e9:.2f} GB", flush=True)

    # correctness of the registered path
    dests_check = [torch.zeros_like(d) for d in dests]
    whole_files(files, dests_check, stream, READ_ONLY)
    ok = all(torch.equal(d.cpu(), torch.from_file(str(p), size=p.stat().st_size, dtype=torch.uint8))
             for d, p in zip(dests_check, files, strict=True))
    print("registered copy bytes equal the files:", ok, flush=True)
    del dests_check

    variants = {
        "load_rank (ring)": lambda: load_rank(out, 0, device=device),
        "whole file, ReadOnly": lambda: whole_files(files, dests, stream, READ_ONLY),
    }
    try:
        whole_files(files[:1], dests[:1], stream, 0)
        variants["whole file, default flags"] = lambda: whole_files(files, dests, stream, 0)
    except RuntimeError as e:
        print("default flags refused:", e)
    for mb in (16, 64, 256):
        for threads in (1, 4, 8, 16):
            variants[f"chunk {mb}MB x{threads}"] = (lambda mb=mb, threads=threads:
                                                     chunked(files, dests, stream, mb << 20, threads, False))
    rows = {}
    for name, fn in variants.items():
        fn()
        times, extra = [], None
        for _ in range(5):
            torch.cuda.synchronize()
            s = time.perf_counter()
            r = fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - s)
            extra = r if isinstance(r, dict) and all(isinstance(v, float) for v in r.values()) else extra
            del r
        med = statistics.median(times)
        rows[name] = {"warm_s": round(med, 4), "gb_per_s": round(nbytes / med / 1e9, 2),
                      **({k: round(v, 4) for k, v in extra.items()} if extra else {})}
        print(f"{name:28s} warm {med * 1e3:7.1f} ms  {nbytes / med / 1e9:6.1f} GB/s  {extra or ''}", flush=True)
    for name, fn in (("load_rank (ring)", variants["load_rank (ring)"]),
                     ("chunk 64MB x8", variants["chunk 64MB x8"]),
                     ("chunk 64MB x8 +WILLNEED", lambda: chunked(files, dests, stream, 64 << 20, 8, True)),
                     ("chunk 16MB x16 +WILLNEED", lambda: chunked(files, dests, stream, 16 << 20, 16, True))):
        drop_page_cache()
        s = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        cold = time.perf_counter() - s
        del r
        rows.setdefault(name, {})["cold_s"] = round(cold, 4)
        print(f"{name:28s} cold {cold * 1e3:7.1f} ms  {nbytes / cold / 1e9:6.1f} GB/s", flush=True)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    big = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        s = time.perf_counter()
        big.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
    rows["h2d_pinned"] = {"warm_s": round(statistics.median(times), 4)}
    median = statistics.median(times)
    print(f"h2d pinned limit {median * 1e3:.1f} ms  {nbytes / median / 1e9:.1f} GB/s")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
