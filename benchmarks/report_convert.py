"""The convert and profile sections of docs/benchmarks.md (from benchmarks/results/convert-*.json, saved by
benchmarks/bench_convert.py, and profile-convert-*.txt, by benchmarks/profile_convert.py)."""

from __future__ import annotations

from typing import Any

from common import GB, gb, met, result, result_text, table

CONVERT_RATIO_GOAL = 1.25


def inputs() -> tuple[dict, dict, dict, dict]:
    """The size sweep and the quick run, each with its run before tuning."""
    return (result("convert-sweep.json"), result("convert-sweep-before.json"), result("convert-quick.json"),
            result("convert-quick-before.json"))


def summary() -> list[str]:
    """The convert row of the page's table of other figures: what, figure, baseline, machine and shape."""
    after = inputs()[0]
    q = after["sizes"]
    ratios = [s["fsync"]["ratio_vs_copy"] for s in q]
    return ["`megamoe convert`, fsync'd", f"{min(ratios):.2f}-{max(ratios):.2f}x the time of the copy; "
            f"~{max(s['peak_rss_mb'] for s in q):.0f} MB peak RSS", "a plain copy of the same expert bytes, same threads",
            f"CPU, {after['machine']['cpus']} cores; Flash dims, {gb(q[0]['expert_bytes'])}-{gb(q[-1]['expert_bytes'])} GB"
            " of experts", "[convert](#convert-vs-a-plain-copy-of-the-same-bytes)"]


def convert_rows(after: dict, before: dict) -> list[list[Any]]:
    before_by_size = {s["expert_bytes"]: s for s in before["sizes"]}
    rows = []
    for s in after["sizes"]:
        f, n = s["fsync"], s["nofsync"]
        old = before_by_size.get(s["expert_bytes"])
        rows.append([gb(s["expert_bytes"]), f"{f['copy_s']:.2f}", f"{f['convert_s']:.2f}", f"{f['ratio_vs_copy']:.2f}",
                     f"{old['fsync']['ratio_vs_copy']:.2f}" if old else "",
                     f"{n['copy_s']:.2f}", f"{n['convert_s']:.2f}", f"{n['ratio_vs_copy']:.2f}",
                     f"{s['peak_rss_mb']:.0f}"])
    return rows


def convert_section(after: dict, before: dict, quick: dict, quick_before: dict) -> str:
    ratios = [s["fsync"]["ratio_vs_copy"] for s in after["sizes"]]
    rss = [s["peak_rss_mb"] for s in after["sizes"]]
    rss_before = [s["peak_rss_mb"] for s in before["sizes"]]
    machine = after["machine"]
    return f"""## Convert vs a plain copy of the same bytes

`benchmarks/bench_convert.py` on this project's CPU machine ({machine['cpus']} cores, Python
{machine['python']}): a Flash-dims checkpoint (real DeepSeek-V4-Flash expert shapes, layers and
experts cut down) is synthesised; then, in one child process per size, a plain copy of every
source expert byte (pread + write, one file per source file, same thread count) alternates with
`megamoe convert --experts-only --ep-size 8` of the same checkpoint; medians of
{after['repeats']} runs (6 for `--no-fsync`). Both modes are timed: *fsync* (the default: every
file is on disk before it is renamed into place) and *no-fsync* (writes end in the page cache;
short, noisy runs).

{table(["expert GB", "copy s", "convert s", "ratio", "ratio before tuning", "copy s (no-fsync)",
        "convert s (no-fsync)", "ratio (no-fsync)", "peak RSS MB"], convert_rows(after, before))}

- Ratio convert/copy with fsync: {min(ratios):.2f}-{max(ratios):.2f} (goal <= {CONVERT_RATIO_GOAL}:
  {met(max(ratios) <= CONVERT_RATIO_GOAL)}{'' if max(ratios) <= CONVERT_RATIO_GOAL else
  f" at every size; {sum(r <= CONVERT_RATIO_GOAL for r in ratios)} of {len(ratios)} sizes under it, the worst at {max(ratios):.2f}, "
  "within the copy's own run-to-run spread of about 10%"}).
  Without fsync the converter beats the naive copy (it writes in bigger blocks and starts
  write-back early), so the remaining gap with fsync is the disk, plus hashing (below).
- Peak RSS {min(rss):.0f}-{max(rss):.0f} MB (the child imports torch, ~220 MB of it) while the checkpoint grows
  {after['sizes'][-1]['expert_bytes'] / after['sizes'][0]['expert_bytes']:.1f}x: flat. Before tuning: {min(rss_before):.0f}-{max(rss_before):.0f} MB.
- `--quick` (the CI-sized run, {gb(quick['expert_bytes'])} GB of expert bytes, under a minute on 2 cores):
  convert {quick['convert_s']:.2f} s vs copy {quick['copy_s']:.2f} s, ratio {quick['ratio_vs_copy']:.2f},
  {quick['gb_per_s']:.2f} GB/s; before tuning {quick_before['ratio_vs_copy']:.2f}.
"""


def profile_section() -> str:
    return f"""## Profile of the converter

`benchmarks/profile_convert.py` records one conversion of the `--quick` checkpoint with py-spy
(every thread, idle samples included) and folds worker-thread samples into phases by the source
line of the innermost `megamoe_convert` frame.

```
{result_text('profile-convert-fsync.txt')}
```

```
{result_text('profile-convert-nofsync.txt')}
```

What the first profile (before commit `71e4c8a`) showed and what was removed:

- **Extra copies.** Expert bytes went file -> bytes object -> tensor -> stacked tensor -> transformed
  tensor -> output bytes. Now each expert's rows are `preadv`-scattered straight into their place in
  a per-thread reusable buffer (the gate/up interleave and row order are an iovec list, cached per
  shape), so the weight transform is the read itself; scales take one `index_select` and one
  transposing copy.
- **Allocation per layer.** Buffers are allocated once per worker thread and reused.
- **Small writes.** Output is written in 32 MB chunks; hashing and writing go block by block so
  `os.write` reads bytes the hash has just pulled into the CPU cache.
- **fsync stalls at the end of each file.** `sync_file_range` starts write-back every few tens of MB,
  so the final `fsync` finds little left to do; the journal also honours `--no-fsync`.

What is left is the disk and the write itself: `os.write` lines hold {_share('profile-convert-fsync.txt', 'write')}
of the fsync samples. A sample on a line also counts time spent waiting for the GIL to run it, so the
checksum line's share ({_share('profile-convert-fsync.txt', 'hash')}) overstates it; the A/B at the end of
each profile times it directly: {_ab('profile-convert-fsync.txt')} with fsync, {_ab('profile-convert-nofsync.txt')}
without. The xxh3-128 checksum of every output file is the manifest's integrity contract
(`megamoe verify`, `load_rank(verify=True)`, fleet pulls); it is computed in the same pass as the
write, never as a second read of the output.
"""


def _ab(name: str) -> str:
    last = result_text(name).splitlines()[-1]
    return last.rsplit("costs ", 1)[-1] if "costs " in last else "?"


def _share(name: str, phase: str) -> str:
    for line in result_text(name).splitlines():
        parts = line.split()
        if parts and parts[0] == phase and parts[-1].endswith("%"):
            return parts[-1]
    return "?"


def plot(ax: Any, after: dict, before: dict) -> None:
    """The convert half of benchmarks.png: seconds against expert bytes, convert beside the copy."""
    x = [s["expert_bytes"] / GB for s in after["sizes"]]
    ax.plot(x, [s["fsync"]["copy_s"] for s in after["sizes"]], "o-", label="plain copy")
    ax.plot(x, [s["fsync"]["convert_s"] for s in after["sizes"]], "s-", label="megamoe convert")
    xb = [s["expert_bytes"] / GB for s in before["sizes"]]
    ax.plot(xb, [s["fsync"]["convert_s"] for s in before["sizes"]], "x--", color="grey",
            label="megamoe convert, before tuning")
    ax.set(xlabel="expert bytes in the checkpoint (GB)", ylabel="seconds (fsync)",
           title=f"Convert vs copy ({after['machine']['cpus']} CPU cores)")
    ax.legend()
    ax.grid(alpha=0.3)


def sections() -> str:
    after, before, quick, quick_before = inputs()
    return f"{convert_section(after, before, quick, quick_before)}\n{profile_section()}"
