#!/usr/bin/env python3
"""Does verifying a rank cost little more than reading it? ``megamoe verify`` beside a plain read.

Synthesises a Flash-dims checkpoint (``bench_convert.py``'s ``--quick`` size), converts it
(``--experts-only``), then times, warm (files in the page cache; an untimed pass first), for
the rank's files, alternating, ``--repeats`` times, medians:

  read        read every file of the rank in 16 MiB pieces into one buffer, nothing else,
              on one thread (``read_parallel``: one file per thread, as many threads as verify);
  verify      ``megamoe_convert.verify.verify(out, ranks=R)``: the manifest, every file's size
              and xxh3-128 checksum (files on ``writer.CHECK_THREADS`` threads), every shard's
              header against the manifest;
  sha256      the plain read plus SHA-256 of every piece: what a conventional hash would cost;
  load_rank   ``load_rank(out, R, verify=True)`` on CPU (checksums, then mmap).

The last line is JSON: ``read_s``, ``verify_s``, ``ratio_verify_vs_read``, ``sha256_s``, ...;
``--save FILE`` writes it too (read by ``benchmarks/make_report.py``).

``--numerics`` times instead what a user runs on a whole conversion (every rank), once each, cold
imports aside: ``verify OUT``, ``verify OUT --source SRC``, ``... --numerics`` (every MoE layer once,
the ranks in turn: the default) and ``... --numerics --numerics-every-rank``, with the seconds per
numerics check (default shape: Flash dims, 2 layers + MTP, 16 experts, EP 8).

    python benchmarks/bench_verify.py [--save benchmarks/results/verify.json]
    python benchmarks/bench_verify.py --smoke --workdir /tmp/x    # seconds (CI runs it)
    python benchmarks/bench_verify.py --numerics [--save benchmarks/results/verify-numerics.json]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import bench_config, emit_summary, ensure_checkpoint, run_convert  # noqa: E402

PIECE_BYTES = 16 << 20


def read_files(files: list[Path], digest: Callable[[], "hashlib._Hash"] | None = None) -> int:
    """Read the files in pieces into one reused buffer (hashing each piece if ``digest``)."""
    buf = bytearray(PIECE_BYTES)
    view = memoryview(buf)
    total = 0
    for path in files:
        h = digest() if digest else None
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                if h is not None:
                    h.update(view[:n])
                total += n
    return total


def read_files_parallel(files: list[Path], threads: int) -> int:
    """:func:`read_files` with one file per thread, as many threads as verify checksums with."""
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda f: read_files([f]), files))


def rank_files(out: Path, rank: int) -> list[Path]:
    from megamoe_convert.output.manifest import read_manifest

    return [out / record.path for record in read_manifest(out).rank_files(rank).values()]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny preset, one repeat: seconds (CI runs it)")
    p.add_argument("--preset", default="flash")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "megamoe-bench-convert"))
    p.add_argument("--save")
    p.add_argument("--numerics", action="store_true", help="verify's levels on a whole conversion, numerics included")
    args = p.parse_args(argv)
    if args.numerics:
        return bench_numerics(args)
    if args.smoke:
        args.preset, args.layers, args.experts, args.ep_size, args.repeats = "tiny", 1, 8, 2, 1

    from megamoe_convert.output import writer
    from megamoe_convert.serve.loader import load_rank
    from megamoe_convert.verify import verify

    started = time.perf_counter()
    work = Path(args.workdir)
    src, out = work / f"src-L{args.layers}", work / "verify-out"
    src = work / f"src-{args.preset}-L{args.layers}"
    ensure_checkpoint(src, bench_config(args.preset, args.layers, args.experts, 0, 1280))
    shutil.rmtree(out, ignore_errors=True)
    run_convert(src, out, args.ep_size, 2, False)
    files = rank_files(out, args.rank)
    rank_bytes = sum(f.stat().st_size for f in files)

    def verify_rank() -> None:
        report = verify(out, ranks=str(args.rank))
        assert report.ok, report.to_json()

    methods: dict[str, Callable[[], object]] = {
        "read": lambda: read_files(files),
        "read_parallel": lambda: read_files_parallel(files, writer.CHECK_THREADS),
        "verify": verify_rank,
        "sha256": lambda: read_files(files, hashlib.sha256),
        "load_rank": lambda: load_rank(out, args.rank, verify=True),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for method in methods.values():
        method()  # warm the page cache and imports
    for _ in range(args.repeats):
        for name, method in methods.items():
            start = time.perf_counter()
            method()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    summary = {
        "benchmark": "verify", "rank_bytes": rank_bytes, "files": len(files), "ep_size": args.ep_size,
        "read_s": round(median["read"], 4), "verify_s": round(median["verify"], 4),
        "sha256_s": round(median["sha256"], 4), "load_rank_verify_s": round(median["load_rank"], 4),
        "read_parallel_s": round(median["read_parallel"], 4), "check_threads": writer.CHECK_THREADS,
        "ratio_verify_vs_read": round(median["verify"] / median["read"], 3),
        "ratio_verify_vs_read_parallel": round(median["verify"] / median["read_parallel"], 3),
        "ratio_sha256_vs_read": round(median["sha256"] / median["read"], 3),
        "gb_per_s": {name: round(rank_bytes / s / 1e9, 2) for name, s in median.items()},
        "runs": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    shutil.rmtree(out, ignore_errors=True)
    emit_summary(summary, args.save)
    return summary


def bench_numerics(args: argparse.Namespace) -> dict:
    """``verify``'s levels on a whole conversion, each timed once (the conversion converted once)."""
    from megamoe_convert.verify import verify

    if args.smoke:
        args.preset, args.layers, args.experts, args.ep_size = "tiny", 1, 8, 2
    else:  # the defaults of the read benchmark are not this one's
        args.layers = 2 if args.layers == 3 else args.layers
        args.experts = 16 if args.experts == 32 else args.experts
        args.ep_size = 8 if args.ep_size == 2 else args.ep_size
    started = time.perf_counter()
    work = Path(args.workdir)
    src, out = work / f"src-{args.preset}-L{args.layers}-E{args.experts}-mtp", work / "verify-numerics-out"
    ensure_checkpoint(src, bench_config(args.preset, args.layers, args.experts, 1, 1280))
    shutil.rmtree(out, ignore_errors=True)
    convert_s = time.perf_counter()
    run_convert(src, out, args.ep_size, 2, False)
    convert_s = time.perf_counter() - convert_s
    levels = {"verify": {}, "source": {"source": src}, "numerics": {"source": src, "numerics": True},
              "numerics_every_rank": {"source": src, "numerics": True, "numerics_every_rank": True}}
    rows = {}
    for name, kwargs in levels.items():
        start = time.perf_counter()
        report = verify(out, **kwargs)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
        assert report.ok, report.to_json()
        checks = report.numerics["layers"] if report.numerics else 0
        numerics_s = report.phases.get("numerics", {}).get("seconds", 0.0)
        rows[name] = {"seconds": round(seconds, 2), "numerics_checks": checks, "numerics_s": round(numerics_s, 2),
                      "s_per_check": round(numerics_s / checks, 2) if checks else None}
    from megamoe_convert.output.manifest import read_manifest

    manifest = read_manifest(out)
    summary = {
        "benchmark": "verify-numerics", "preset": args.preset, "layers": [layer.key for layer in manifest.layers],
        "experts": args.experts, "ep_size": args.ep_size, "hidden": manifest.dims.hidden_size,
        "intermediate": manifest.dims.moe_intermediate_size, "weight_format": manifest.dims.weight_format,
        "convert_s": round(convert_s, 2), "levels": rows,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    shutil.rmtree(out, ignore_errors=True)
    emit_summary(summary, args.save)
    return summary


if __name__ == "__main__":
    main()
