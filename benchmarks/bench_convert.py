#!/usr/bin/env python3
"""Convert at the speed of a copy? ``megamoe convert`` beside a plain copy of the same expert bytes.

For each checkpoint size: synthesise a checkpoint with real DeepSeek-V4 expert dimensions
(a preset, cut down in layers and experts; the vocabulary is cut too, since only expert
bytes are timed), then, in one child process per size, alternate

  (a) copy:    read every source expert tensor (``pread`` of each file's expert byte ranges,
               16 MiB at a time, one thread per worker) and write the same bytes to files
               in the output filesystem, fsync'd like the converter's files;
  (b) convert: ``megamoe_convert.convert.convert(..., experts_only=True)`` of the same
               checkpoint into a fresh directory (what ``megamoe convert --experts-only`` runs),

each ``--repeats`` times, and report medians. Both run with the same thread count and both
read a warm page cache (an untimed copy runs first); ``os.sync()`` runs before every timed
run so one run's write-back does not land in the next. Two write modes are timed:
``fsync`` (the converter's default: every file is on disk before it is renamed) and
``nofsync`` (``--no-fsync``: writes end in the page cache; its runs are short and noisy,
so they are repeated twice as often). Times are measured inside the
child, after imports (Python start-up and ``import torch`` are not counted).

The last line printed is JSON: ``convert_s``, ``copy_s``, ``ratio_vs_copy`` and ``gb_per_s``
of the largest size in the default mode, ``peak_rss_mb`` (peak RSS of the child, which
imports torch), and ``sizes``: every size's numbers. ``--save FILE`` also writes it there
(``benchmarks/make_report.py`` reads ``benchmarks/results/*.json``).

    python benchmarks/bench_convert.py --quick                # one ~1.3 GB checkpoint, < 1 min on 2 cores
    python benchmarks/bench_convert.py --smoke                # the tiny preset: seconds (CI runs it)
    python benchmarks/bench_convert.py --layers 1,2,4,8       # the size sweep of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import REPO, bench_config, drop_page_cache, emit_summary, ensure_checkpoint, run_convert

COPY_BUFFER_BYTES = 16 << 20


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------

def expert_ranges(src: Path) -> list[tuple[str, list[tuple[int, int]]]]:
    """Per source file, the byte ranges of its routed-expert tensors, adjacent ones merged."""
    from megamoe_convert.source.checkpoint import Checkpoint

    ckpt = Checkpoint.open(src)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, entry in ckpt.tensors.items():
        if ckpt.names.under_experts(name):
            by_file.setdefault(str(entry.path), []).append((entry.begin, entry.end))
    result = []
    for path, ranges in sorted(by_file.items()):
        merged: list[tuple[int, int]] = []
        for begin, end in sorted(ranges):
            if merged and merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((begin, end))
        result.append((path, merged))
    return result


# --------------------------------------------------------------------------------------
# The two timed operations
# --------------------------------------------------------------------------------------

def plain_copy(ranges: list[tuple[str, list[tuple[int, int]]]], out: Path, workers: int, fsync: bool) -> int:
    """Read every expert byte range, write it to one output file per source file."""
    out.mkdir(parents=True)

    def copy_file(number: int, path: str, spans: list[tuple[int, int]]) -> int:
        buf = bytearray(COPY_BUFFER_BYTES)
        view = memoryview(buf)
        src = os.open(path, os.O_RDONLY)
        dst = os.open(out / f"experts-{number:05d}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        copied = 0
        try:
            for begin, end in spans:
                offset = begin
                while offset < end:
                    n = os.preadv(src, [view[:min(len(buf), end - offset)]], offset)
                    written = 0
                    while written < n:
                        written += os.write(dst, view[written:n])
                    offset += n
                    copied += n
            if fsync:
                os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)
        return copied

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(lambda item: copy_file(item[0], *item[1]), enumerate(ranges)))


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_main(args: argparse.Namespace) -> None:
    """One size: warm up, then alternate copy and convert, in every write mode."""
    import torch  # noqa: F401  (imported before timing starts, and counted in the RSS baseline)

    from megamoe_convert import convert as _convert  # noqa: F401

    src, scratch = Path(args.src), Path(args.scratch)
    workers = args.workers or min(8, os.cpu_count() or 1)
    ranges = expert_ranges(src)
    expert_bytes = sum(end - begin for _, spans in ranges for begin, end in spans)
    baseline_rss = rss_mb()
    times: dict[str, list[float]] = {}
    out_bytes: dict[str, int] = {}

    def timed(kind: str, mode: str) -> None:
        out = scratch / f"{kind}-out"
        for previous in ("copy", "convert"):  # deleted before the sync: dirty pages of deleted
            shutil.rmtree(scratch / f"{previous}-out", ignore_errors=True)  # files need no write-back
        fsync = mode == "fsync"
        if args.cold:
            drop_page_cache()
        else:
            os.sync()
        start = time.perf_counter()
        if kind == "copy":
            n = plain_copy(ranges, out, workers, fsync)
        else:
            n = run_convert(src, out, args.ep_size, workers, fsync)
        times.setdefault(f"{mode}.{kind}", []).append(time.perf_counter() - start)
        out_bytes[kind] = n

    scratch.mkdir(parents=True, exist_ok=True)
    timed("copy", "nofsync")  # warm-up: source bytes into the page cache, files created once
    times.clear()
    for mode in args.modes:
        for repeat in range(args.repeats * (2 if mode == "nofsync" else 1)):  # short runs: more of them
            for kind in (("convert", "copy") if repeat % 2 else ("copy", "convert")):
                timed(kind, mode)
    for kind in ("copy", "convert"):
        shutil.rmtree(scratch / f"{kind}-out", ignore_errors=True)
    result = {"expert_bytes": expert_bytes, "copy_bytes": out_bytes["copy"], "convert_bytes": out_bytes["convert"],
              "workers": workers, "baseline_rss_mb": round(baseline_rss, 1), "peak_rss_mb": round(peak_rss_mb(), 1)}
    for mode in args.modes:
        copy_s, convert_s = (statistics.median(times[f"{mode}.{k}"]) for k in ("copy", "convert"))
        result[mode] = {"copy_s": round(copy_s, 3), "convert_s": round(convert_s, 3),
                        "ratio_vs_copy": round(convert_s / copy_s, 3),
                        "gb_per_s": round(expert_bytes / convert_s / 1e9, 3),
                        "copy_gb_per_s": round(expert_bytes / copy_s / 1e9, 3),
                        "copy_min_s": round(min(times[f"{mode}.copy"]), 3),
                        "convert_min_s": round(min(times[f"{mode}.convert"]), 3),
                        "copy_runs": [round(t, 3) for t in times[f"{mode}.copy"]],
                        "convert_runs": [round(t, 3) for t in times[f"{mode}.convert"]]}
    print("CHILD_RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one ~1.3 GB Flash-dims checkpoint, 3 repeats (< 1 min)")
    p.add_argument("--smoke", action="store_true", help="the tiny preset, one run of each arm: seconds (CI runs it)")
    p.add_argument("--preset", default="flash", help="expert dims: flash | pro | tiny | a config JSON")
    p.add_argument("--layers", default="2", help="decoder layers of each size, comma-separated (e.g. 1,2,4,8)")
    p.add_argument("--experts", type=int, default=32, help="routed experts per layer")
    p.add_argument("--mtp", type=int, default=1, help="MTP layers")
    p.add_argument("--vocab", type=int, default=1280, help="vocabulary (non-expert bytes only; not timed)")
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=0, help="threads for both copy and convert (0: convert's default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="fsync,nofsync", help="write modes to time: fsync, nofsync")
    p.add_argument("--cold", action="store_true", help="drop the page cache before every timed run (needs root)")
    p.add_argument("--workdir", default=os.environ.get("MEGAMOE_BENCH_DIR", "/tmp/megamoe-bench"))
    p.add_argument("--keep", action="store_true", help="keep the synthesised checkpoints for the next run")
    p.add_argument("--save", help="also write the final JSON to this file")
    p.add_argument("--tag", default="", help="free text stored in the JSON (e.g. 'before')")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.quick:
        args.layers, args.repeats = "2", min(args.repeats, 3)
    if args.smoke:
        args.preset, args.layers, args.experts, args.ep_size, args.repeats = "tiny", "1", 8, 2, 1
        args.modes = ["nofsync"]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return {}
    workdir = Path(args.workdir)
    sizes = []
    started = time.perf_counter()
    for layers in (int(x) for x in args.layers.split(",")):
        config = bench_config(args.preset, layers, args.experts, args.mtp, args.vocab)
        src = workdir / f"src-{args.preset}-L{layers}-E{args.experts}-M{args.mtp}"
        synth_s = ensure_checkpoint(src, config)
        cmd = [sys.executable, __file__, "--child", "--src", str(src), "--scratch", str(workdir / "scratch"),
               "--ep-size", str(args.ep_size), "--workers", str(args.workers), "--repeats", str(args.repeats),
               "--modes", ",".join(args.modes)] + (["--cold"] if args.cold else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"child for {src.name} failed ({proc.returncode})")
        result = json.loads(proc.stdout.split("CHILD_RESULT ", 1)[1])
        result.update(layers=layers + args.mtp, experts=args.experts, synth_s=round(synth_s, 2))
        sizes.append(result)
        line = "  ".join(f"{m}: copy {result[m]['copy_s']:.2f}s convert {result[m]['convert_s']:.2f}s "
                         f"x{result[m]['ratio_vs_copy']:.2f}" for m in args.modes)
        print(f"{result['expert_bytes'] / 1e9:6.2f} GB ({layers}+{args.mtp} layers x {args.experts} experts)  {line}"
              f"  peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    largest, mode = sizes[-1], args.modes[0]
    summary = {
        "benchmark": "convert", "tag": args.tag, "preset": args.preset, "mode": mode, "ep_size": args.ep_size,
        "expert_bytes": largest["expert_bytes"],
        "convert_s": largest[mode]["convert_s"], "copy_s": largest[mode]["copy_s"],
        "ratio_vs_copy": largest[mode]["ratio_vs_copy"], "gb_per_s": largest[mode]["gb_per_s"],
        "peak_rss_mb": max(s["peak_rss_mb"] for s in sizes),
        "peak_rss_growth_mb": round(max(s["peak_rss_mb"] for s in sizes) - min(s["peak_rss_mb"] for s in sizes), 1),
        "sizes": sizes, "repeats": args.repeats, "cold": args.cold,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    emit_summary(summary, args.save)
    return summary


if __name__ == "__main__":
    main()
