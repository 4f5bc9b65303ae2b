#!/usr/bin/env python3
"""Where does ``megamoe convert`` spend its time? A py-spy profile of one conversion, by phase.

Synthesises the ``bench_convert.py --quick`` checkpoint (real DeepSeek-V4 Flash expert dims),
converts it once untimed (warm page cache), then runs a second conversion under
``py-spy record`` (every thread, idle samples included, so waiting on I/O shows) and folds
the samples into phases by the innermost frame that names one: reading source bytes,
the layout transform, hashing, writing, fsync, waiting (a pool or queue with nothing to do),
other. This is the profile the converter was tuned against (docs/benchmarks.md).

    pip install py-spy
    python benchmarks/profile_convert.py [--fsync] [--save benchmarks/results/profile-convert.txt]
    python benchmarks/profile_convert.py --smoke --workdir /tmp/x   # seconds (CI runs it)
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
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
out, src, fsync = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "1"
shutil.rmtree(out, ignore_errors=True)
run_convert(src, out, 8, 2, fsync)
shutil.rmtree(out)
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
run_convert(src, out, 8, 2, fsync)
print("wall", time.perf_counter() - start, flush=True)
shutil.rmtree(out)
"""

#: Phase of a sample, from the source line of its innermost megamoe_convert frame.
LINE_PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fsync", ("fsync", "start_writeback")),
    ("hash", ("hasher.update", "hexdigest")),
    ("write", ("os.write", "os.replace")),
    ("read source", ("readv_into", "read_into", "preadv")),
    ("layout (gather/permute)", ("index_select", ".copy_(", "torch.")),
)
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+):(?P<line>\d+)\)$")


def source_line(file: str, line: int) -> str:
    path = REPO / file
    try:
        return path.read_text().splitlines()[line - 1]
    except (OSError, IndexError):
        return ""


def phase_of(stack: list[str]) -> str:
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
        if not any("convert/convert.py" in f for f in stack) and not any("_worker (concurrent" in f for f in stack):
            continue  # before "go" / after the conversion
        if stack and stack[0].startswith("<module>") and any("Event.wait" in f or "Condition.wait" in f for f in stack):
            coordinator_waits += int(count)
            continue
        phases[phase_of(stack)] += int(count)
        leaves[stack[-1]] += int(count)
    return phases, leaves, coordinator_waits


def report(phases: collections.Counter, leaves: collections.Counter, coordinator_waits: int, wall_s: float,
           fsync: bool) -> str:
    total = sum(phases.values()) or 1
    lines = [f"# py-spy profile of one convert ({'fsync' if fsync else '--no-fsync'}), 250 Hz, idle included;"
             f" wall {wall_s:.2f} s",
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


def hash_cost(src: Path, out: Path, fsync: bool, repeats: int = 6) -> tuple[float, float]:
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
                run_convert(src, out, 8, 2, fsync)
                times[hashed].append(time.perf_counter() - start)
    finally:
        writer.new_hasher = real
        shutil.rmtree(out, ignore_errors=True)
    return statistics.median(times[True]), statistics.median(times[False])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fsync", action="store_true", help="profile the default fsync mode (default: --no-fsync,"
                   " where the converter's own work is not hidden behind the disk)")
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
    src = work / ("src-tiny" if args.smoke else "src-L3")
    ensure_checkpoint(src, bench_config("tiny", 1, 8, 0, 1280) if args.smoke else bench_config("flash", 3, 32, 0, 1280))
    if args.smoke and not have_spy:
        hashed, unhashed = hash_cost(src, work / "profile-out", args.fsync, repeats=1)
        print(f"smoke: convert {hashed:.3f} s with the checksum, {unhashed:.3f} s without; py-spy is not installed, "
              "so no profile was recorded")
        return
    raw = work / "profile.raw"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO / "benchmarks"), str(work / "profile-out"),
                              str(src), str(int(args.fsync))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    child.stdout.readline()  # "ready": imports done, one untimed conversion done (warm page cache)
    spy = subprocess.Popen([py_spy, "record", "--idle", "--rate", "250", "--format", "raw", "--output", str(raw),
                            "--pid", str(child.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let py-spy attach
    child.stdin.write("go\n")
    child.stdin.flush()
    wall_s = float(child.stdout.readline().split()[1])
    child.wait()
    spy.wait()
    text = report(*fold(raw), wall_s, args.fsync)
    hashed, unhashed = hash_cost(src, work / "profile-out", args.fsync)
    text += (f"\n\nA/B, same process, median of 6: convert {hashed:.3f} s with the xxh3-128 checksum, "
             f"{unhashed:.3f} s without: the checksum costs {hashed / unhashed - 1:.1%}")
    print(text)
    if args.save:
        Path(args.save).write_text(text + "\n")


if __name__ == "__main__":
    main()
