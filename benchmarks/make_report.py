#!/usr/bin/env python3
"""Regenerate docs/benchmarks.md and docs/benchmarks.png from benchmarks/results/.

Every number in the report is read from the JSON (and profile text) the benchmark scripts
saved; the prose between the tables explains them and says which goals are met. Rerun a
benchmark with ``--save benchmarks/results/<name>.json``, then this script.

    pip install -e '.[bench]'
    python benchmarks/make_report.py
    python benchmarks/make_report.py --no-plots --out /tmp/x/benchmarks.md   # text only (CI compares it)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import report_daemon
import report_node
import report_probe
import report_startup
import report_store

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
GB = 1e9

#: Goals of the benchmarks issue.
CONVERT_RATIO_GOAL = 1.25
LOAD_VS_H2D_GOAL = 0.8
SPEEDUP_GOAL = 5.0


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def text(name: str) -> str:
    return (RESULTS / name).read_text().rstrip()


def gb(n: float) -> str:
    return f"{n / GB:.2f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def met(ok: bool) -> str:
    return "met" if ok else "**not met**"


# --------------------------------------------------------------------------------------
# Convert
# --------------------------------------------------------------------------------------

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
{text('profile-convert-fsync.txt')}
```

```
{text('profile-convert-nofsync.txt')}
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
    last = text(name).splitlines()[-1]
    return last.rsplit("costs ", 1)[-1] if "costs " in last else "?"


def _share(name: str, phase: str) -> str:
    for line in text(name).splitlines():
        parts = line.split()
        if parts and parts[0] == phase and parts[-1].endswith("%"):
            return parts[-1]
    return "?"


def verify_section(v: dict) -> str:
    g = v["gb_per_s"]
    rows = [[name, f"{v[key] * 1e3:.0f}", f"{g[gkey]:.1f}"] for name, key, gkey in (
        ("plain read, one thread", "read_s", "read"),
        (f"plain read, {v['check_threads']} threads", "read_parallel_s", "read_parallel"),
        ("`megamoe verify --ranks R` (xxh3-128)", "verify_s", "verify"),
        ("`load_rank(verify=True)`, CPU", "load_rank_verify_s", "load_rank"),
        ("plain read + SHA-256", "sha256_s", "sha256"))]
    return f"""## Verify vs a plain read of the same rank

`benchmarks/bench_verify.py`: one rank ({gb(v['rank_bytes'])} GB in {v['files']} files) of a converted
Flash-dims checkpoint, warm page cache (the hash's worst case: cold, the disk sets the pace for
both), medians of {v['repeats']}, {v['machine']['cpus']} CPU cores.

{table(["", "ms", "GB/s"], rows)}

Verifying costs {v['ratio_verify_vs_read']:.2f}x a single-threaded read and {v['ratio_verify_vs_read_parallel']:.2f}x a
parallel one; a SHA-256 of the same bytes would cost {v['ratio_sha256_vs_read']:.1f}x. That is why the manifest's
checksum is xxh3-128 (an integrity check against corruption and truncation, not a defence
against an adversary: for that, pin the hub revision (a commit hash) and trust your storage).
"""


def numerics_section(n: dict) -> str:
    """``bench_verify.py --numerics``: verify's levels on a whole conversion, numerics included."""
    lv = n["levels"]
    rows = [[label, f"{lv[key]['seconds']:.1f}", str(lv[key]["numerics_checks"] or "-"),
             f"{lv[key]['s_per_check']:.1f}" if lv[key]["s_per_check"] else "-"] for label, key in (
        ("`megamoe verify OUT` (sizes, checksums)", "verify"),
        ("`... --source SRC` (every slot's bytes)", "source"),
        ("`... --source SRC --numerics` (every MoE layer once, the ranks in turn)", "numerics"),
        ("`... --numerics --numerics-every-rank` (every rank x layer)", "numerics_every_rank"))]
    per = lv["numerics"]["s_per_check"]
    return f"""### `verify --numerics` against the plain verify

`benchmarks/bench_verify.py --numerics`: a whole conversion, every rank, each level timed once
({n['preset']} dims H={n['hidden']}, I={n['intermediate']}, {n['weight_format']} experts;
{len(n['layers'])} MoE layers ({', '.join(n['layers'])}), {n['experts']} experts, EP {n['ep_size']};
{n['machine']['cpus']} CPU cores, a machine shared with other work; converting took {n['convert_s']:.1f} s).

{table(["", "seconds", "numerics checks", "s per check"], rows)}

A numerics check runs two local slots of a rank (its first and last) and the layer's shared expert,
so its cost does not grow with the experts per rank. A full DeepSeek-V4-Flash (43 MoE layers + 1 MTP)
at EP 8 has 44 checks by default: about {44 * per / 60:.0f} minutes at this machine's {per:.1f} s a check
(computed from the rows above, not run); `--device cuda` runs them on a GPU.
"""


# --------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------

WARM_COLUMNS = ("baseline", "load_rank", "safetensors", "fastsafetensors", "h2d_pinned", "h2d_pageable", "host_read")


def warm_rows(result: dict) -> list[list[Any]]:
    rows = []
    for s in result["sizes"]:
        w = s["warm"]
        cells = [f"{gb(s['rank_bytes'])} / {gb(s['source_bytes'])}"]
        cells += [f"{w[c]['s'] * 1e3:.0f} ({w[c]['gb_per_s']:.1f})" if c in w else "-" for c in WARM_COLUMNS]
        cells += [f"{w['baseline']['s'] / w['load_rank']['s']:.1f}x",
                  f"{w['h2d_pinned']['s'] / w['load_rank']['s']:.2f}",
                  f"{w['host_read']['s'] / w['load_rank']['s']:.2f}"]
        rows.append(cells)
    return rows


def cold_rows(result: dict) -> list[list[Any]]:
    rows = []
    for s in result["sizes"]:
        c = s.get("cold", {})
        if "load_rank" not in c:
            continue
        rows.append([f"{gb(s['rank_bytes'])} / {gb(s['source_bytes'])}",
                     f"{c['baseline']['s']:.2f}", f"{c['load_rank']['s']:.2f}",
                     f"{c['safetensors']['s']:.2f}" if "safetensors" in c else "-",
                     f"{c['fastsafetensors']['s']:.2f}" if "fastsafetensors" in c else "-",
                     f"{c['host_read']['s']:.2f}" if "host_read" in c else "-",
                     f"{c['baseline']['s'] / c['load_rank']['s']:.1f}x",
                     gb(c["baseline"]["read_bytes"]), gb(c["load_rank"]["read_bytes"]),
                     f"{c['load_rank']['read_bytes'] / max(1, c['baseline']['read_bytes']):.3f}"])
    return rows


def sweep_rows(sweep: dict) -> list[list[Any]]:
    rows = []
    size = sweep["sizes"][-1]
    for r in size.get("loader_sweep", []):
        rows.append([r["read_threads"], r["ring_buffers"], r["ring_mb"], f"{r['s'] * 1e3:.0f}",
                     f"{size['rank_bytes'] / r['s'] / GB:.1f}", f"{r['first_s'] * 1e3:.0f}"])
    return rows


def load_section(main: dict, other: dict, sweep: dict) -> str:
    last = main["sizes"][-1]
    w = last["warm"]
    header = ["rank GB / checkpoint GB", *(f"{c} ms (GB/s)" for c in WARM_COLUMNS),
              "speedup vs baseline", "load / pinned H2D", "load / host_read"]
    speedups = [s["warm"]["baseline"]["s"] / s["warm"]["load_rank"]["s"] for s in main["sizes"]]
    h2d = [s["warm"]["h2d_pinned"]["s"] / s["warm"]["load_rank"]["s"] for s in main["sizes"]]
    host = [s["warm"]["host_read"]["s"] / s["warm"]["load_rank"]["s"] for s in main["sizes"]]
    other_speedups = [s["warm"]["baseline"]["s"] / s["warm"]["load_rank"]["s"] for s in other["sizes"]]
    other_h2d = [s["warm"]["h2d_pinned"]["s"] / s["warm"]["load_rank"]["s"] for s in other["sizes"]]
    m = main["machine"]
    return f"""## Load one rank onto the GPU vs the vLLM-style baseline (repeated calls, one process)

An earlier benchmark, kept for its limits and tuning: its baseline is the seed's emulated path, not
vLLM's code, and it reports medians of repeated calls; the start-up section above supersedes it.

`benchmarks/bench_load.py` on an {main['device']} ({m['cpus']} CPUs, torch {m['torch']}),
one rank (rank {main['rank']} of EP {main['ep_size']}) of Flash-dims checkpoints with 1, 2 and 4 MoE
layers of 256 experts. In one process: **baseline** reads every source shard the way vLLM's
iterator does, keeps the rank's experts, stacks w1/w3, widens the scales and transforms on the
GPU; **load_rank** is `load_rank(out, rank, device="cuda")`; **h2d_pinned** copies one pinned host
buffer of the rank's bytes (the PCIe limit); **h2d_pageable** the same from ordinary memory;
**safetensors** is `safe_open(device="cuda")` of the rank's converted files; **fastsafetensors**
(0.5.0, no GDS) the same; **host_read** is load_rank's host half alone (page cache -> pinned
buffers, same threads and pieces, no device copy). Every `load_rank` result equals the baseline's
tensors (values, dtypes, shapes, strides): `all_correct = {main['all_correct']}`.

### Warm (files in the page cache), median of 5

{table(header, warm_rows(main))}

### Cold (page cache dropped before each run), seconds and bytes read from disk

{table(["rank GB / checkpoint GB", "baseline s", "load_rank s", "safetensors s", "fastsafetensors s", "host_read s",
        "speedup", "baseline GB read", "load_rank GB read", "read fraction"], cold_rows(main))}

### The same benchmark on another lease of the same machine type

Host memory bandwidth differs from lease to lease (other tenants, NUMA placement); the second full
run, same code and settings:

{table(header, warm_rows(other))}

### Tuning the pinned ring (4-layer size, warm, same process)

{table(["read threads", "ring buffers", "buffer MB", "ms", "GB/s", "first call ms"], sweep_rows(sweep))}

The defaults (`loader.READ_THREADS = min(16, cpus)`, 24 buffers of 16 MB) are the fastest row.

### Goals

| goal | measured | |
|---|---|---|
| load >= {SPEEDUP_GOAL:.0f}x faster than the baseline | warm {min(speedups):.1f}-{max(speedups):.1f}x (other lease {min(other_speedups):.1f}-{max(other_speedups):.1f}x), cold {min(r['cold_speedup_vs_baseline'] for r in main['sizes']):.1f}-{max(r['cold_speedup_vs_baseline'] for r in main['sizes']):.1f}x | {met(min(speedups) >= SPEEDUP_GOAL)}{'' if min(other_speedups) >= SPEEDUP_GOAL else ' (not at the smallest size on the slow lease)'} |
| bytes read per rank = 1/ep_size of the expert bytes | {main['bytes_read_fraction']:.4f} of the checkpoint's bytes, cold `read_bytes` agreeing: 1/{main['ep_size']} of its expert bytes (it also holds non-expert tensors) | met |
| load >= {LOAD_VS_H2D_GOAL}x the pinned H2D limit, warm | {min(h2d):.2f}-{max(h2d):.2f}x (other lease {min(other_h2d):.2f}-{max(other_h2d):.2f}x) | {met(min(h2d) >= LOAD_VS_H2D_GOAL)} |
| (the real ceiling here) load vs host_read, warm | {min(host):.2f}-{max(host):.2f}x, largest size {host[-1]:.2f}x | |

### Why not 0.8x of pinned H2D

Pinned H2D runs at {w['h2d_pinned']['gb_per_s']:.0f} GB/s, but on this machine the bytes first have to
get from the page cache into pinned memory, and that is a CPU memory copy: `host_read`, that copy
alone with no GPU involved, peaks at {w['host_read']['gb_per_s']:.0f} GB/s ({w['host_read']['s'] / w['h2d_pinned']['s']:.1f}x the H2D time).
`load_rank` overlaps its H2D copies with those reads, so it runs at {max(host):.2f}x of host_read:
it is bounded by host memory bandwidth, not by PCIe or by Python. Routes around the CPU copy:

- **Register the page cache itself** (`cudaHostRegister` of the mmap'd shard, so the DMA engine
  reads the page cache directly): measured by `benchmarks/probe_register.py` and a dead end.
  Pinning the pages costs more than copying them (1.2-1.8 GB/s, registration dominating, for
  whole files, chunks and 1-16 threads alike):

```
{text('probe-register-h100.log')}
```

- **GPUDirect Storage** (cuFile, fastsafetensors with GDS) reads from NVMe straight into GPU
  memory, skipping host memory altogether; that machine has no GDS (fastsafetensors ran with
  `nogds=True`, which goes through host memory and is slower than `load_rank`). Cold, all readers
  are disk-bound and equal (`load_rank` ~ `host_read` ~ safetensors ~ fastsafetensors): the win
  there is reading 1/{main['ep_size']} of the bytes, which the converted layout gives.
"""


# --------------------------------------------------------------------------------------
# Plot and driver
# --------------------------------------------------------------------------------------

def plot(after: dict, before: dict, main: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [s["expert_bytes"] / GB for s in after["sizes"]]
    ax1.plot(x, [s["fsync"]["copy_s"] for s in after["sizes"]], "o-", label="plain copy")
    ax1.plot(x, [s["fsync"]["convert_s"] for s in after["sizes"]], "s-", label="megamoe convert")
    xb = [s["expert_bytes"] / GB for s in before["sizes"]]
    ax1.plot(xb, [s["fsync"]["convert_s"] for s in before["sizes"]], "x--", color="grey",
             label="megamoe convert, before tuning")
    ax1.set(xlabel="expert bytes in the checkpoint (GB)", ylabel="seconds (fsync)",
            title=f"Convert vs copy ({after['machine']['cpus']} CPU cores)")
    ax1.legend()
    ax1.grid(alpha=0.3)

    x = [s["source_bytes"] / GB for s in main["sizes"]]
    for key, label, style in (("baseline", "vLLM-style baseline", "o-"), ("load_rank", "load_rank", "s-"),
                              ("host_read", "host read only (page cache -> pinned)", "^:"),
                              ("h2d_pinned", "pinned H2D only", "v:")):
        ax2.plot(x, [s["warm"][key]["s"] for s in main["sizes"]], style, label=label)
    ax2.set(xlabel="checkpoint size (GB); one rank of EP 8", ylabel="seconds (warm)", yscale="log",
            title=f"Load one rank ({main['device']})")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def headline(after: dict, main: dict) -> str:
    q = after["sizes"]
    big = report_startup.load_all()[-1]
    warm, cold = report_startup.by_method(big, "warm"), report_startup.by_method(big, "cold")
    node = report_node.headline()
    return (f"{node}{chr(10) * 2 if node else ''}Start-up, first call in a fresh process on an H100 (rank 0 of EP 8, 1.71 GB of a 13.85 GB "
            f"checkpoint): `install()` into vLLM 0.33's real modules takes {warm['ours']['load_s'] * 1e3:.0f} ms warm "
            f"and {cold['ours']['load_s']:.2f} s cold; vLLM 0.33's own loading code takes "
            f"{warm['vllm033_ep_filter']['load_s']:.2f}-{warm['vllm033_all']['load_s']:.2f} s warm and "
            f"{cold['vllm033_all']['load_s']:.1f}-{cold['vllm033_ep_filter']['load_s']:.1f} s cold, reading 8x the bytes. "
            f"Converting runs at {min(s['fsync']['ratio_vs_copy'] for s in q):.2f}-"
            f"{max(s['fsync']['ratio_vs_copy'] for s in q):.2f}x the time of a plain copy of the same bytes with flat memory "
            f"(~{max(s['peak_rss_mb'] for s in q):.0f} MB peak RSS up to {gb(q[-1]['expert_bytes'])} GB).")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    p.add_argument("--no-plots", action="store_true", help="write the text only (no matplotlib needed): CI checks "
                                                          "that docs/benchmarks.md is what the results give")
    args = p.parse_args(argv)
    after, before = load("convert-sweep.json"), load("convert-sweep-before.json")
    quick, quick_before = load("convert-quick.json"), load("convert-quick-before.json")
    main_load, other_load, sweep = load("load-h100.json"), load("load-h100-run2.json"), load("load-h100-sweep.json")
    out = Path(args.out)
    png = out.with_suffix(".png")
    startup_png = out.with_name("startup.png")
    if not args.no_plots:
        plot(after, before, main_load, png)
        report_startup.plot(report_startup.load_all(), startup_png)
    doc = f"""# Benchmarks

<!-- Generated by benchmarks/make_report.py from benchmarks/results/; edit that script, not this file. -->

{headline(after, main_load)}

![time vs checkpoint size]({png.name})

Reproduce: `python benchmarks/bench_convert.py --layers 2,3,5,9 --save benchmarks/results/convert-sweep.json`
(CPU), `PYTHONPATH=. python3 benchmarks/bench_load.py --repeats 5 --save benchmarks/results/load-h100.json`
(GPU), `python benchmarks/profile_convert.py [--fsync] --save ...`,
`python benchmarks/bench_verify.py --save benchmarks/results/verify.json` (and `--numerics --save
benchmarks/results/verify-numerics.json`), then `python benchmarks/make_report.py`.
`make bench` runs the quick convert benchmark.

{report_node.section()}
{report_startup.section(startup_png.name)}
{report_daemon.section()}
{report_store.section()}
{report_probe.section()}
{convert_section(after, before, quick, quick_before)}
{profile_section()}
{verify_section(load("verify.json"))}
{numerics_section(load("verify-numerics.json"))}
{load_section(main_load, other_load, sweep)}"""
    out.write_text(doc)
    print(f"wrote {out}" + ("" if args.no_plots else f", {png} and {startup_png}"))


if __name__ == "__main__":
    main()
