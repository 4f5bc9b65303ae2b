#!/usr/bin/env python3
"""Convert at the disk's speed? ``megamoe convert`` beside a plain copy of the same bytes, at each worker count.

Synthesise one checkpoint with real DeepSeek-V4 expert dimensions (a preset cut down in layers and
experts; the vocabulary too, since only expert bytes are timed), then, in one child process, for
every worker count of ``--workers`` (comma-separated), alternate

  (a) copy:    for every rank file the conversion writes, the source tensors it is made of (its
               routed experts and the layer's fused shared expert), read with ``pread`` 16 MiB at
               a time and written to one file of the rank file's size (the tensors again from the
               start where the layout is larger), each file fsync'd like the converter's: as many
               files and bytes as the conversion writes, on as many threads as it has workers;
  (b) convert: ``convert(..., experts_only=True)`` of the same checkpoint into a fresh directory
               (what ``megamoe convert --experts-only`` runs),

``--repeats`` times each. Runs are interleaved: each round visits every worker count (in a rotated
order), and within it the copy and the conversion run back to back, copy first in every other round.
Both read a warm page cache (an untimed copy and conversion run first); ``os.sync()`` runs before
every timed run so one run's write-back does not land in the next. ``fsync`` is the converter's
default (every file on disk before it is renamed); ``nofsync`` (``--no-fsync``) ends in the page
cache. Times are measured inside the child, after imports (Python start-up and ``import torch``
are not counted). A worker count's ratio is the median of its rounds' convert/copy ratios (each
round's pair ran side by side, so drift between rounds cancels). Peak memory is measured apart, for
each worker count: a fresh process (torch imported) converts once, and its peak RSS is set against
its RSS before (a process that converted before holds freed memory its allocator kept).

Each result records the machine: CPUs, memory, and the disk under ``--workdir`` (its model from
/sys/block, the filesystem, free space, the kernel's write-back thresholds). The last line printed
is JSON: ``rows`` (one per mode and worker count), and the headline ``convert_s``, ``copy_s`` and
``ratio_vs_copy`` of the worst row of the first mode. ``--save FILE`` also writes it there
(``benchmarks/make_report.py`` reads ``benchmarks/results/convert-*.json``).

    python benchmarks/bench_convert.py --quick                     # ~1.9 GB written, median of 5 rounds
    python benchmarks/bench_convert.py --smoke                     # seconds (CI runs it)
    python benchmarks/bench_convert.py --layers 8 --workers 2,8,16,64 --save benchmarks/results/convert-NAME.json
    python benchmarks/bench_convert.py ... --code /path/to/other/checkout   # the same runs, another version
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import REPO, bench_config, drop_page_cache, emit_summary, ensure_checkpoint, run_convert

COPY_BUFFER_BYTES = 16 << 20
MB = 2**20


# --------------------------------------------------------------------------------------
# The machine and its disk
# --------------------------------------------------------------------------------------

def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _mount_of(path: Path) -> dict[str, str]:
    """The mount holding ``path`` (the longest mount point above it): its point, type and source."""
    best = {"point": "", "fs": "unknown", "source": ""}
    real = str(path.resolve())
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        fields = line.split()
        point, rest = fields[4], fields[fields.index("-") + 1:]
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best["point"]):
            best = {"point": point, "fs": rest[0], "source": rest[1] if len(rest) > 1 else ""}
    return best


def disk_info(path: Path) -> dict[str, Any]:
    """What holds ``path``: the block device (model from /sys/block), filesystem and free space."""
    st = os.stat(path)
    node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    info: dict[str, Any] = {"device": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", "model": "unknown"}
    if node.exists():
        real = node.resolve()
        disk = real.parent if (real / "partition").exists() else real
        link = disk / "device" / "driver"
        driver = Path(os.path.realpath(link)).name if link.exists() else ""
        model = " ".join(x for x in (_read(disk / "device" / "vendor"), _read(disk / "device" / "model")) if x)
        info.update(device=real.name, disk=disk.name, model=model or driver or "unknown", driver=driver,
                    rotational=_read(disk / "queue" / "rotational") == "1",
                    size_gb=round(int(_read(disk / "size") or 0) * 512 / 1e9, 1),
                    scheduler=_read(disk / "queue" / "scheduler"))
    usage = shutil.disk_usage(path)
    info.update(filesystem=_mount_of(path), free_gb=round(usage.free / 1e9, 1), total_gb=round(usage.total / 1e9, 1))
    return info


def machine_info(path: Path) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in _read(Path("/proc/cpuinfo")).splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) for line in _read(Path("/proc/meminfo")).splitlines()
                if line.startswith("MemTotal:")), 0)
    vm = {name: _read(Path("/proc/sys/vm") / name) for name in
          ("dirty_background_ratio", "dirty_ratio", "dirty_background_bytes", "dirty_bytes")}
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        smi = ""
    gpus = [line.split(":", 1)[1].split("(")[0].strip() for line in smi.splitlines() if line.startswith("GPU ")]
    return {"cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": cpu,
            "memory_gb": round(mem / 1e6, 1), "platform": platform.platform(), "python": platform.python_version(),
            "gpus": gpus, "disk": disk_info(path), "vm": vm}


# --------------------------------------------------------------------------------------
# The copy of the same bytes
# --------------------------------------------------------------------------------------

def copy_plan(src: Path, ep_size: int) -> list[tuple[int, list[tuple[str, int, int]]]]:
    """For every rank file the conversion writes: its size, and the source byte ranges it is made of."""
    import threading

    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import build_plan
    from megamoe_convert.source.safetensors_io import FileCache

    with FileCache() as files:
        plan = build_plan(src, Path(os.devnull), ConvertOptions(ep_size=ep_size, experts_only=True), files,
                          threading.Event())
    ckpt, by_expert, shared = plan.ckpt, {}, {}
    for name, entry in sorted(ckpt.tensors.items(), key=lambda item: (str(item[1].path), item[1].begin)):
        parsed = ckpt.names.parse_expert(name)
        span = (str(entry.path), entry.begin, entry.end)
        if parsed is not None:
            by_expert.setdefault((parsed[0].key, parsed[1]), []).append(span)
        for layer in plan.layers:
            if name.startswith(ckpt.names.shared_prefix(layer)):
                shared.setdefault(layer.key, []).append(span)
    files_out = []
    for unit in (u for u in plan.units if u.kind == "experts"):
        assert unit.layer is not None and unit.rank is not None
        ids = plan.placement_for(unit.layer).rank_logical_ids(unit.rank)
        spans = [s for e in ids for s in by_expert[unit.layer.key, e]] + shared.get(unit.layer.key, [])
        files_out.append((unit.file_size, spans))
    return files_out


def plain_copy(plan: list[tuple[int, list[tuple[str, int, int]]]], out: Path, workers: int, fsync: bool) -> int:
    """Each output file filled with its source ranges (again from the first where it is larger)."""
    out.mkdir(parents=True)

    def copy_file(number: int, size: int, spans: list[tuple[str, int, int]]) -> int:
        buf = mmap.mmap(-1, COPY_BUFFER_BYTES)  # its own pages, given back when closed
        view = memoryview(buf)
        fds = {path: os.open(path, os.O_RDONLY) for path in {s[0] for s in spans}}
        dst = os.open(out / f"copy-{number:05d}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        copied = 0
        try:
            while copied < size:
                for path, begin, end in spans:
                    offset = begin
                    while offset < end and copied < size:
                        n = os.preadv(fds[path], [view[:min(len(buf), end - offset, size - copied)]], offset)
                        written = 0
                        while written < n:
                            written += os.write(dst, view[written:n])
                        offset += n
                        copied += n
            if fsync:
                os.fsync(dst)
        finally:
            for fd in (*fds.values(), dst):
                os.close(fd)
            view.release()
            buf.close()
        return copied

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(lambda item: copy_file(item[0], *item[1]), enumerate(plan)))


# --------------------------------------------------------------------------------------
# The child: every worker count, interleaved
# --------------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    line = next(row for row in _read(Path("/proc/self/status")).splitlines() if row.startswith(field + ":"))
    return int(line.split()[1])


def import_code(code: str) -> float:
    """Import torch and the converter (``code``: from that checkout); this process's RSS after, in MB."""
    if code:
        sys.path.insert(0, code)  # the version under test, ahead of this checkout
    import torch  # noqa: F401  (imported before timing starts, and counted in the RSS baseline)

    from megamoe_convert.convert import run as _run  # noqa: F401

    return _status_kb("VmRSS") / 1024


def memory_main(args: argparse.Namespace) -> None:
    """One conversion in this fresh process: its peak RSS, and its RSS before."""
    baseline_mb = import_code(args.code)
    out = Path(args.scratch) / "memory-out"
    shutil.rmtree(out, ignore_errors=True)
    run_convert(Path(args.src), out, args.ep_size, args.workers[0], args.modes[0] == "fsync")
    shutil.rmtree(out)
    print("CHILD_RESULT " + json.dumps({"baseline_rss_mb": round(baseline_mb, 1),
                                        "peak_rss_mb": round(_status_kb("VmHWM") / 1024, 1)}), flush=True)


def child_main(args: argparse.Namespace) -> None:
    import_code(args.code)
    src, scratch = Path(args.src), Path(args.scratch)
    plan = copy_plan(src, args.ep_size)
    times: dict[tuple[str, int, str], list[float]] = {}
    written: dict[str, int] = {}

    def timed(kind: str, mode: str, workers: int) -> None:
        for previous in ("copy", "convert"):  # deleted before the sync: dirty pages of deleted
            shutil.rmtree(scratch / f"{previous}-out", ignore_errors=True)  # files need no write-back
        drop_page_cache() if args.cold else os.sync()
        start = time.perf_counter()
        if kind == "copy":
            n = plain_copy(plan, scratch / "copy-out", workers, mode == "fsync")
        else:
            n = run_convert(src, scratch / "convert-out", args.ep_size, workers, mode == "fsync")
        times.setdefault((mode, workers, kind), []).append(time.perf_counter() - start)
        written[kind] = n

    scratch.mkdir(parents=True, exist_ok=True)
    timed("copy", "nofsync", args.workers[0])  # warm-up: source bytes into the page cache
    timed("convert", "nofsync", args.workers[0])  # ... and the converter's code paths
    times.clear()
    for mode in args.modes:
        for repeat in range(args.repeats):
            turn = repeat % len(args.workers)
            for index, workers in enumerate(args.workers[turn:] + args.workers[:turn]):
                for kind in (("copy", "convert") if (repeat + index) % 2 == 0 else ("convert", "copy")):
                    timed(kind, mode, workers)
    for kind in ("copy", "convert"):
        shutil.rmtree(scratch / f"{kind}-out", ignore_errors=True)
    rows = [row(mode, workers, times, written) for mode in args.modes for workers in args.workers]
    print("CHILD_RESULT " + json.dumps({"rows": rows, "copy_bytes": written["copy"],
                                        "convert_bytes": written["convert"], "copy_files": len(plan)}), flush=True)


def row(mode: str, workers: int, times: dict[tuple[str, int, str], list[float]],
        written: dict[str, int]) -> dict[str, Any]:
    copy, convert = times[mode, workers, "copy"], times[mode, workers, "convert"]
    ratios = [c / p for c, p in zip(convert, copy, strict=True)]
    return {"mode": mode, "workers": workers, "copy_s": round(statistics.median(copy), 3),
            "convert_s": round(statistics.median(convert), 3), "ratio_vs_copy": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
            "gb_per_s": round(written["convert"] / statistics.median(convert) / 1e9, 3),
            "copy_gb_per_s": round(written["copy"] / statistics.median(copy) / 1e9, 3),
            "copy_runs": [round(t, 3) for t in copy], "convert_runs": [round(t, 3) for t in convert]}


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2+1 layers (~1.9 GB written), 5 rounds (make bench)")
    p.add_argument("--smoke", action="store_true", help="the tiny preset, 3 rounds: seconds (CI runs it)")
    p.add_argument("--preset", default="flash", help="expert dims: flash | pro | tiny | a config JSON")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (plus --mtp)")
    p.add_argument("--experts", type=int, default=32, help="routed experts per layer")
    p.add_argument("--mtp", type=int, default=1, help="MTP layers")
    p.add_argument("--vocab", type=int, default=1280, help="vocabulary (non-expert bytes only; not timed)")
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--workers", default="0", help="worker counts, comma-separated (0: convert's default)")
    p.add_argument("--repeats", type=int, default=3, help="rounds: each runs every worker count's pair once "
                                                          "(0: peak memory alone)")
    p.add_argument("--modes", default="fsync", help="write modes to time, comma-separated: fsync, nofsync")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs (a fresh process each)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before every timed run (needs root)")
    p.add_argument("--workdir", default=os.environ.get("MEGAMOE_BENCH_DIR", "/tmp/megamoe-bench"))
    p.add_argument("--keep", action="store_true", help="keep the synthesised checkpoint for the next run")
    p.add_argument("--code", default="", help="import megamoe_convert from this checkout (an A/B of versions)")
    p.add_argument("--save", help="also write the final JSON to this file")
    p.add_argument("--tag", default="", help="free text stored in the JSON (e.g. 'before')")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.repeats = 2, max(args.repeats, 5)
    if args.smoke:  # fixed costs outweigh a few MB of experts: it runs the code, it times nothing
        args.preset, args.layers, args.experts, args.mtp, args.ep_size, args.repeats = "tiny", 1, 64, 0, 2, 3
        args.modes, args.workers = "nofsync", "2"
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    default = min(8, os.cpu_count() or 1)
    args.workers = [int(w) or default for w in str(args.workers).split(",") if w.strip()]
    return args


def run_child(args: argparse.Namespace, src: Path, role: str, workers: list[int]) -> dict[str, Any]:
    """A child process (``role``: ``--child`` or ``--memory``) over ``src``; its result."""
    cmd = [sys.executable, __file__, role, "--src", str(src), "--scratch", str(Path(args.workdir) / "scratch"),
           "--ep-size", str(args.ep_size), "--workers", ",".join(map(str, workers)), "--repeats", str(args.repeats),
           "--modes", ",".join(args.modes), "--code", args.code, *(["--cold"] if args.cold else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"bench_convert: the {role} child for {src.name} failed ({proc.returncode})")
    return json.loads(proc.stdout.split("CHILD_RESULT ", 1)[1])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child or args.memory:
        (child_main if args.child else memory_main)(args)
        return {}
    started = time.perf_counter()
    workdir = Path(args.workdir)
    config = bench_config(args.preset, args.layers, args.experts, args.mtp, args.vocab)
    src = workdir / f"src-{Path(args.preset).stem}-L{args.layers}-E{args.experts}-M{args.mtp}"
    synth_s = ensure_checkpoint(src, config)
    result = run_child(args, src, "--child", args.workers) if args.repeats else {  # 0: memory alone
        "rows": [{"mode": args.modes[0], "workers": w} for w in args.workers], "copy_bytes": 0, "convert_bytes": 0,
        "copy_files": 0}
    for workers in [] if args.no_memory else args.workers:
        memory = run_child(args, src, "--memory", [workers])
        for r in (r for r in result["rows"] if r["workers"] == workers):
            r.update(memory, peak_rss_growth_mb=round(memory["peak_rss_mb"] - memory["baseline_rss_mb"], 1))
    first = [r for r in result["rows"] if r["mode"] == args.modes[0]]
    worst = max(first, key=lambda r: r.get("ratio_vs_copy", 0.0))
    summary = {
        "benchmark": "convert", "tag": args.tag, "preset": args.preset, "layers": args.layers + args.mtp,
        "experts": args.experts, "ep_size": args.ep_size, "mode": args.modes[0], "repeats": args.repeats,
        "cold": args.cold, "code": args.code or "this checkout",
        "expert_bytes": result["convert_bytes"], "copy_bytes": result["copy_bytes"],
        "files": result["copy_files"], "convert_s": worst.get("convert_s"), "copy_s": worst.get("copy_s"),
        "ratio_vs_copy": worst.get("ratio_vs_copy"), "gb_per_s": worst.get("gb_per_s"), "workers": args.workers,
        "peak_rss_mb": max((r["peak_rss_mb"] for r in result["rows"] if "peak_rss_mb" in r), default=None),
        "rows": result["rows"],
        "machine": machine_info(workdir), "synth_s": round(synth_s, 1),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    print(f"{'mode':<8}{'workers':>8}{'copy s':>9}{'convert s':>11}{'ratio':>8}{'(min-max)':>14}"
          f"{'GB/s':>7}{'peak RSS MB':>16}")
    for r in result["rows"] if args.repeats else []:
        peak = f"{r['peak_rss_mb']:.0f} (+{r['peak_rss_growth_mb']:.0f})" if "peak_rss_mb" in r else "-"
        print(f"{r['mode']:<8}{r['workers']:>8}{r['copy_s']:>9.2f}{r['convert_s']:>11.2f}{r['ratio_vs_copy']:>8.2f}"
              f"{r['ratio_min']:>8.2f}-{r['ratio_max']:<5.2f}{r['gb_per_s']:>7.2f}{peak:>16}", flush=True)
    emit_summary(summary, args.save)
    return summary


if __name__ == "__main__":
    main()
