#!/usr/bin/env python3
"""Where does ``megamoe convert`` spend its time? A py-spy profile of one conversion, by phase.

Synthesises the ``bench_convert.py --quick`` checkpoint (real DeepSeek-V4 Flash expert dims),
converts it once untimed (warm page cache), then runs a second conversion under
``py-spy record`` (every thread, idle samples included, so waiting on I/O shows) and folds
the samples into phases by the innermost frame that names one: reading source bytes,
the layout (scales, the shared expert once a layer), hashing, writing, fsync, waiting (a pool
or queue with nothing to do), other. ``--gil`` profiles a third conversion sampling only the
thread that holds the GIL: its samples over the wall time are the GIL's busy share, which says
whether Python itself is what the workers queue on. This is the profile the converter was tuned
against (docs/benchmarks.md).

    pip install py-spy
    python benchmarks/profile_convert.py [--fsync] [--workers 16] [--gil] [--save FILE]
    python benchmarks/profile_convert.py --smoke --workdir /tmp/x   # seconds (CI runs it)
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import bench_config, ensure_checkpoint  # noqa: E402

#: The profiled process: import, convert once untimed, say "ready", wait for "go", convert, say the wall time.
CHILD = """
import shutil, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from common import run_convert
out, src, fsync, workers = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
shutil.rmtree(out, ignore_errors=True)
run_convert(src, out, 8, workers, fsync)
shutil.rmtree(out)
print("ready", flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    run_convert(src, out, 8, workers, fsync)
    print("wall", time.perf_counter() - start, flush=True)
    shutil.rmtree(out)
"""

#: Phase of a sample, from the source line of its innermost megamoe_convert frame.
LINE_PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fsync", ("fsync", "start_writeback")),
    ("hash", ("hasher.update", "hexdigest")),
    ("write", ("os.write", "os.replace")),
    ("read source", ("readv_into", "read_into", "preadv")),
    ("layout (gather/permute)", ("np.take", "np.copyto", "index_select", ".copy_(", "torch.")),
)
#: Phases named by a function anywhere on the stack, before the innermost line is looked at.
STACK_PHASES: tuple[tuple[str, str], ...] = (
    ("shared expert (once a layer)", "shared_expert_chunks"),
    ("waiting: another rank file lays out the shared expert", "SharedExpertCache.tensors"),
)
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+):(?P<line>\d+)\)$")


def source_line(file: str, line: int) -> str:
    path = REPO / file
    try:
        return path.read_text().splitlines()[line - 1]
    except (OSError, IndexError):
        return ""


def phase_of(stack: list[str]) -> str:
    for phase, func in STACK_PHASES:
        if any(frame.startswith(func + " ") for frame in stack):
            return phase
    for frame in reversed(stack):
        m = FRAME.match(frame)
        if m is None or not m["file"].startswith("megamoe_convert/"):
            continue
        text = source_line(m["file"], int(m["line"]))
        for phase, needles in LINE_PHASES:
            if any(n in text for n in needles):
                return phase
        if m["file"].endswith(("checkpoint.py", "manifest.py")) or any(
                f in m["func"] for f in ("build_plan", "read_header", "_parse_entry")):
            return "plan + headers"
        return f"python in {m['file'].removeprefix('megamoe_convert/')}"
    return "pool idle" if any("_worker (concurrent" in f for f in stack) else "other"


def fold(raw: Path) -> tuple[collections.Counter, collections.Counter, int]:
    """py-spy's raw (collapsed) output -> worker samples per phase and per innermost frame, and
    the main thread's samples spent waiting for the pool (it only coordinates)."""
    phases: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    coordinator_waits = 0
    for line in raw.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        stack = stack_text.split(";")
        if not any("convert/run.py" in f for f in stack) and not any("_worker (concurrent" in f for f in stack):
            continue  # before "go" / after the conversion
        if stack and stack[0].startswith("<module>") and any("Event.wait" in f or "Condition.wait" in f for f in stack):
            coordinator_waits += int(count)
            continue
        phases[phase_of(stack)] += int(count)
        leaves[stack[-1]] += int(count)
    return phases, leaves, coordinator_waits


def report(phases: collections.Counter, leaves: collections.Counter, coordinator_waits: int, wall_s: float,
           fsync: bool, workers: int, rate: int) -> str:
    total = sum(phases.values()) or 1
    lines = [f"# py-spy profile of one convert ({'fsync' if fsync else '--no-fsync'}, {workers} workers), {rate} Hz,"
             f" idle included; wall {wall_s:.2f} s",
             f"# worker-thread samples by phase (the main thread, waiting on the pool: {coordinator_waits} samples)",
             "", f"{'phase':<32}{'samples':>9}{'share':>8}"]
    lines += [f"{name:<32}{n:>9}{n / total:>8.1%}" for name, n in phases.most_common()]
    lines += ["", "top innermost frames:"]
    lines += [f"{n:>7}  {frame}" for frame, n in leaves.most_common(15)]
    return "\n".join(lines)


class _NoHash:
    """Stands in for the checksum in :func:`hash_cost`'s second arm."""

    def update(self, data: object) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 32


def hash_cost(src: Path, out: Path, fsync: bool, workers: int, repeats: int = 6) -> tuple[float, float]:
    """Median convert seconds with the real checksum and with none, alternating, in this process.

    The profile cannot say this by itself: a sample on a line also counts time spent waiting
    for the GIL to run it."""
    import statistics

    from common import run_convert

    from megamoe_convert.output import writer

    real = writer.new_hasher
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(repeats):
            for hashed in (True, False):
                writer.new_hasher = real if hashed else _NoHash
                shutil.rmtree(out, ignore_errors=True)
                start = time.perf_counter()
                run_convert(src, out, 8, workers, fsync)
                times[hashed].append(time.perf_counter() - start)
    finally:
        writer.new_hasher = real
        shutil.rmtree(out, ignore_errors=True)
    return statistics.median(times[True]), statistics.median(times[False])


def profiled(py_spy: str, child: subprocess.Popen, raw: Path, rate: int, gil: bool) -> float:
    """One conversion of the waiting child under py-spy; its wall seconds."""
    assert child.stdout is not None and child.stdin is not None
    flags = ["--gil"] if gil else ["--idle"]
    spy = subprocess.Popen([py_spy, "record", *flags, "--rate", str(rate), "--format", "raw", "--output", str(raw),
                            "--pid", str(child.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let py-spy attach
    child.stdin.write("go\n")
    child.stdin.flush()
    wall_s = float(child.stdout.readline().split()[1])
    spy.send_signal(signal.SIGINT)  # py-spy writes its samples on Ctrl-C
    spy.wait()
    return wall_s


def gil_holders(raw: Path, wall_s: float, rate: int) -> tuple[float, collections.Counter]:
    """Samples of a GIL-holding thread inside the conversion over the samples its wall time holds,
    and the innermost frames that held it."""
    leaves: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines() if raw.exists() else []:
        stack_text, _, count = line.rpartition(" ")
        if "convert/run.py" in stack_text or "_worker (concurrent" in stack_text:
            leaves[stack_text.split(";")[-1]] += int(count)
    return sum(leaves.values()) / max(1.0, wall_s * rate), leaves


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--fsync", action="store_true", help="profile the default fsync mode (default: --no-fsync,"
                   " where the converter's own work is not hidden behind the disk)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the checkpoint (plus one MTP layer)")
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--gil", action="store_true", help="also profile a conversion for the GIL's busy share")
    p.add_argument("--ab-repeats", type=int, default=6, help="checksum A/B pairs (0: none)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "megamoe-bench-convert"))
    p.add_argument("--save", help="also write the report here")
    p.add_argument("--smoke", action="store_true", help="the tiny preset, one A/B pair; the py-spy profile only "
                                                       "where py-spy is installed: seconds (CI runs it)")
    args = p.parse_args(argv)
    have_spy = shutil.which("py-spy") is not None or (Path(sys.executable).parent / "py-spy").exists()
    if not have_spy and not args.smoke:
        sys.exit("profile_convert: py-spy not found (pip install py-spy)")
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")

    work = Path(args.workdir)
    src = work / ("src-tiny" if args.smoke else f"src-flash-L{args.layers}-E32-M1")  # bench_convert's name
    ensure_checkpoint(src, bench_config("tiny", 1, 8, 0, 1280) if args.smoke
                      else bench_config("flash", args.layers, 32, 1, 1280))
    if args.smoke and not have_spy:
        hashed, unhashed = hash_cost(src, work / "profile-out", args.fsync, args.workers, repeats=1)
        print(f"smoke: convert {hashed:.3f} s with the checksum, {unhashed:.3f} s without; py-spy is not installed, "
              "so no profile was recorded")
        return
    raw = work / "profile.raw"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO / "benchmarks"), str(work / "profile-out"),
                              str(src), str(int(args.fsync)), str(args.workers)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    child.stdout.readline()  # "ready": imports done, one untimed conversion done (warm page cache)
    wall_s = profiled(py_spy, child, raw, args.rate, gil=False)
    text = report(*fold(raw), wall_s, args.fsync, args.workers, args.rate)
    if args.gil:
        gil_wall = profiled(py_spy, child, work / "profile-gil.raw", args.rate, gil=True)
        share, holders = gil_holders(work / "profile-gil.raw", gil_wall, args.rate)
        text += (f"\n\nGIL: a thread held it in {share:.0%} of a conversion's samples (wall {gil_wall:.2f} s, "
                 f"{args.workers} workers); innermost frames holding it:\n")
        text += "\n".join(f"{n:>7}  {frame}" for frame, n in holders.most_common(12))
    child.stdin.close()
    child.wait()
    if args.ab_repeats:
        hashed, unhashed = hash_cost(src, work / "profile-out", args.fsync, args.workers, args.ab_repeats)
        text += (f"\n\nA/B, same process, median of {args.ab_repeats}: convert {hashed:.3f} s with the xxh3-128 "
                 f"checksum, {unhashed:.3f} s without: the checksum costs {hashed / unhashed - 1:.1%}")
    print(text)
    if args.save:
        Path(args.save).write_text(text + "\n")


if __name__ == "__main__":
    main()
