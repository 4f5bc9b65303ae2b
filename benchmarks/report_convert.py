"""The convert and profile sections of docs/benchmarks.md (from benchmarks/results/convert-*.json, saved by
benchmarks/bench_convert.py, and profile-convert-*.txt, by benchmarks/profile_convert.py)."""

from __future__ import annotations

from typing import Any

from common import gb, met, result, result_text, table

#: Convert within this factor of a plain copy of the same bytes, at every worker count.
CONVERT_RATIO_GOAL = 1.1
#: The converter before this tuning, as its results record it.
BEFORE = "3d2a945"


def inputs() -> tuple[dict, dict, dict, dict]:
    """The worker sweep and the quick run, each with its run of the converter before tuning."""
    return (result("convert-sweep-64cpu.json"), result("convert-sweep-64cpu-before.json"),
            result("convert-quick-2cpu.json"), result("convert-quick-2cpu-before.json"))


def _fsync(run: dict) -> list[dict]:
    return [r for r in run["rows"] if r["mode"] == "fsync"]


def machine(run: dict) -> str:
    """The machine a result was measured on: CPUs, memory, and the disk under its work folder."""
    m, disk = run["machine"], run["machine"]["disk"]
    gpus = f"; a {len(m['gpus'])} x {m['gpus'][0]} server" if m.get("gpus") else ""
    model = disk["model"]
    kind = f"{disk['driver']} (vendor {model})" if model.startswith("0x") else model
    return (f"{m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gb']:.0f} GB{gpus}; the disk: {kind}, "
            f"{disk['filesystem']['fs']}, {disk['free_gb']:.0f} GB free")


def short_machine(run: dict) -> str:
    m, disk = run["machine"], run["machine"]["disk"]
    return f"{m['cpus']} CPUs, {disk.get('driver') or disk['model']} disk ({disk['filesystem']['fs']})"


def summary() -> list[str]:
    """The convert row of the page's table of other figures: what, figure, baseline, machine and shape."""
    after = inputs()[0]
    rows = _fsync(after)
    ratios = [r["ratio_vs_copy"] for r in rows]
    peaks = [r["peak_rss_growth_mb"] for r in rows]
    workers = f"{rows[0]['workers']}-{rows[-1]['workers']}"
    return ["`megamoe convert`, fsync'd", f"{min(ratios):.2f}-{max(ratios):.2f}x the time of the copy at {workers} "
            f"workers; peak RSS +{min(peaks):.0f} to +{max(peaks):.0f} MB",
            "a plain copy of the same bytes into as many files, same threads, interleaved",
            f"{short_machine(after)}; Flash dims, {gb(after['expert_bytes'])} GB written",
            "[convert](#convert-vs-a-plain-copy-of-the-same-bytes)"]


def sweep_rows(after: dict, before: dict, memory_before: dict) -> list[list[Any]]:
    old = {r["workers"]: r for r in _fsync(before)}
    old_memory = {r["workers"]: r for r in memory_before["rows"]}
    rows = []
    for r in _fsync(after):
        b, m = old.get(r["workers"]), old_memory.get(r["workers"])
        rows.append([r["workers"], f"{r['copy_s']:.2f}", f"{r['convert_s']:.2f}",
                     f"{r['ratio_vs_copy']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})", f"{r['gb_per_s']:.2f}",
                     f"{r['peak_rss_mb']:.0f} (+{r['peak_rss_growth_mb']:.0f})",
                     f"{b['ratio_vs_copy']:.2f} ({b['ratio_min']:.2f}-{b['ratio_max']:.2f})" if b else "",
                     f"{m['peak_rss_mb']:.0f} (+{m['peak_rss_growth_mb']:.0f})" if m else ""])
    return rows


def nofsync_rows(run: dict) -> list[list[Any]]:
    return [[r["workers"], f"{r['copy_s']:.2f}", f"{r['convert_s']:.2f}", f"{r['ratio_vs_copy']:.2f}",
             f"{r['copy_gb_per_s']:.1f}", f"{r['gb_per_s']:.1f}"] for r in run["rows"]]


def convert_section(after: dict, before: dict, quick: dict, quick_before: dict) -> str:
    memory_before, nofsync = result("convert-memory-64cpu-before.json"), result("convert-nofsync-64cpu.json")
    rows = _fsync(after)
    ratios = {r["workers"]: r["ratio_vs_copy"] for r in rows}
    worst = max(ratios, key=lambda w: ratios[w])
    growth = {r["workers"]: r["peak_rss_growth_mb"] for r in rows}
    low, high = min(growth), max(growth)
    per_worker = (growth[high] - growth[low]) / (high - low)
    q, qb = quick["rows"][0], quick_before["rows"][0]
    fastest = max(nofsync["rows"], key=lambda r: r["gb_per_s"])
    return f"""## Convert vs a plain copy of the same bytes

`benchmarks/bench_convert.py` on {machine(after)}; Python {after['machine']['python']}. A Flash-dims
checkpoint ({after['layers']} MoE layers of {after['experts']} experts, real DeepSeek-V4-Flash expert shapes)
is converted by `megamoe convert --experts-only --ep-size {after['ep_size']}` into {after['files']} rank files,
{gb(after['expert_bytes'])} GB (the routed experts and each layer's fused shared expert); the plain copy
copies the same bytes into as many files: for each rank file, the source tensors it is made of,
`pread` 16 MiB at a time and written to a file of its size, fsync'd, on as many threads as the
conversion has workers. At each worker count the copy and the conversion run back to back, in
{after['repeats']} rounds that visit every worker count in turn (the pair's order alternating); a
ratio is the median of the rounds' convert/copy ratios, their range beside it. Peak RSS: a fresh
process converting once, against its RSS with torch imported (~{rows[0]['baseline_rss_mb']:.0f} MB).
*Before*: the converter at commit `{BEFORE}`, timed the same way in an earlier run on the same kind
of host ({before['repeats']} rounds), its peak RSS measured in this run.

{table(["workers", "copy s", "convert s", "ratio (range)", "GB/s", "peak RSS MB (growth)", "before: ratio (range)",
        "before: peak RSS MB (growth)"], sweep_rows(after, before, memory_before))}

- Within {CONVERT_RATIO_GOAL}x of the copy at every worker count: {met(max(ratios.values()) <= CONVERT_RATIO_GOAL)}
  (the worst, {ratios[worst]:.2f}x, at {worst} workers). The disk sets the pace at every worker count:
  the copy wrote {min(r['copy_gb_per_s'] for r in rows):.2f}-{max(r['copy_gb_per_s'] for r in rows):.2f} GB/s,
  the conversion {min(r['gb_per_s'] for r in rows):.2f}-{max(r['gb_per_s'] for r in rows):.2f} GB/s. At
  {low} workers the conversion beats the copy: it hands each file's dirty pages to the disk every 16 MB
  (`sync_file_range`) while it produces the next, where the copy's pages wait for its `fsync`.
- Peak memory grows by ~{per_worker:.0f} MB a worker: each worker's one 4 MiB buffer, and the fused shared
  expert of every layer in flight, laid out once a layer and held until each rank file of the layer
  has it (the layers {high} workers span at once lay theirs out together). Before: +{min(r['peak_rss_growth_mb']
  for r in memory_before['rows']):.0f} to +{max(r['peak_rss_growth_mb'] for r in memory_before['rows']):.0f} MB.

Without fsync the writes end in the page cache, so these runs show what the converter itself can
do beside the copy (same rounds, {nofsync['repeats']} of them, no memory runs):

{table(["workers", "copy s", "convert s", "ratio", "copy GB/s", "convert GB/s"], nofsync_rows(nofsync))}

- The conversion peaks at {fastest['gb_per_s']:.1f} GB/s ({fastest['workers']} workers), {fastest['gb_per_s'] /
  max(r['copy_gb_per_s'] for r in rows):.1f}x the fastest the disk took above, and gains nothing past it; the
  plain copy into the page cache runs at {min(r['copy_gb_per_s'] for r in nofsync['rows'][1:]):.0f}-{max(
  r['copy_gb_per_s'] for r in nofsync['rows']):.0f} GB/s from {nofsync['rows'][1]['workers']} threads on. A disk
  faster than the conversion's own ceiling would make the converter the limit.

`--quick` (`make bench`) on this project's CPU machine ({machine(quick)}), shared with other work:
{gb(quick['expert_bytes'])} GB written, {q['workers']} workers, fsync, median of {quick['repeats']} rounds: convert
{q['convert_s']:.2f} s vs copy {q['copy_s']:.2f} s, ratio {q['ratio_vs_copy']:.2f} ({q['ratio_min']:.2f}-{q['ratio_max']:.2f}),
peak RSS {q['peak_rss_mb']:.0f} MB (+{q['peak_rss_growth_mb']:.0f}); before, in the same way:
{qb['ratio_vs_copy']:.2f} ({qb['ratio_min']:.2f}-{qb['ratio_max']:.2f}), {qb['peak_rss_mb']:.0f} MB
(+{qb['peak_rss_growth_mb']:.0f}). Its shared disk took {q['copy_gb_per_s']:.2f} and {qb['copy_gb_per_s']:.2f} GB/s
in these two runs, and one run's rounds spread wider than the two medians differ: there the ratio
says the conversion keeps a copy's pace, not which version is faster.
"""


def profile_section() -> str:
    return f"""## Profile of the converter

`benchmarks/profile_convert.py` records one conversion of the sweep's checkpoint at 64 workers,
fsync'd, on the host above, with py-spy (every thread, idle samples included), and folds
worker-thread samples into phases by the innermost `megamoe_convert` frame.

```
{result_text('profile-convert-fsync-w64.txt')}
```

What the profiles showed, and what changed:

- **The baseline copied fewer bytes.** A rank file also holds its layer's fused shared expert (a
  third of each file at this shape); the copy copied the routed experts alone. It now copies the
  same bytes into as many files.
- **The shared expert, in every rank file.** Each rank file read it and laid it out again (torch
  ops over tens of MB of temporaries): now the first rank file of a layer lays it out as it starts
  and the others take it at their end. At 64 workers the rank files of the layers in flight still
  wait for it there (above), and the run still keeps the copy's pace.
- **Torch's intra-op threads.** Every worker's torch calls started a team of as many threads as the
  host has cores: a conversion now runs torch on one thread (the worker pool is the parallelism;
  the setting is restored after), the routed scales are permuted in numpy, and the manifest's layout
  identity is computed beside the rank files instead of after the last.
- **Memory per worker.** Each worker held buffers for two experts, and its own copies of the shared
  expert: now one buffer of a 4 MiB piece (an expert's rows, or part of them).
- **Fewer, larger calls.** Data is hashed and written 4 MiB at a time, not 1 MiB: each call lets go
  of the GIL and takes it back.

What is left is the copy's own work (`preadv` and `os.write`), the xxh3-128 checksum (the
manifest's integrity contract: `megamoe verify`, `load_rank(verify=True)`, fleet pulls; computed in
the same pass as the write, never as a second read) and a journal line per file, appended and
fsync'd one at a time.
"""


def plot(ax: Any, after: dict, before: dict) -> None:
    """The convert half of benchmarks.png: seconds against workers, convert beside the copy."""
    rows, old = _fsync(after), _fsync(before)
    ax.plot([r["workers"] for r in rows], [r["copy_s"] for r in rows], "o-", label="plain copy of the same bytes")
    ax.plot([r["workers"] for r in rows], [r["convert_s"] for r in rows], "s-", label="megamoe convert")
    ax.plot([r["workers"] for r in old], [r["convert_s"] for r in old], "x--", color="grey",
            label=f"megamoe convert at {BEFORE} (an earlier run)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["workers"] for r in rows], [str(r["workers"]) for r in rows])
    ax.set(xlabel="workers", ylabel="seconds (fsync)", ylim=(0, None),
           title=f"Convert vs copy, {gb(after['expert_bytes'])} GB ({after['machine']['cpus']} CPUs)")
    ax.legend()
    ax.grid(alpha=0.3)


def sections() -> str:
    after, before, quick, quick_before = inputs()
    return f"{convert_section(after, before, quick, quick_before)}\n{profile_section()}"
