"""The one-process load section of docs/benchmarks.md (from benchmarks/results/load-h100.json, saved by
benchmarks/bench_load.py, and probe-register-h100.log, printed by benchmarks/probe_register.py)."""

from __future__ import annotations

from typing import Any

from common import GB, gb, result, result_text, table

WARM_COLUMNS = ("baseline", "load_rank", "safetensors", "fastsafetensors", "h2d_pinned", "h2d_pageable", "host_read")


def inputs() -> dict[str, Any]:
    return result("load-h100.json")


def warm_rows(run: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for s in run["sizes"]:
        w = s["warm"]
        cells = [f"{gb(s['rank_bytes'])} / {gb(s['source_bytes'])}"]
        cells += [f"{w[c]['s'] * 1e3:.0f} ({w[c]['gb_per_s']:.1f})" if c in w else "-" for c in WARM_COLUMNS]
        cells += [f"{w['baseline']['s'] / w['load_rank']['s']:.1f}x", f"{w['h2d_pinned']['s'] / w['load_rank']['s']:.2f}",
                  f"{w['host_read']['s'] / w['load_rank']['s']:.2f}"]
        rows.append(cells)
    return rows


def cold_rows(run: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for s in run["sizes"]:
        c = s.get("cold", {})
        if "load_rank" not in c:
            continue
        rows.append([f"{gb(s['rank_bytes'])} / {gb(s['source_bytes'])}", f"{c['baseline']['s']:.2f}",
                     f"{c['load_rank']['s']:.2f}", *(f"{c[k]['s']:.2f}" if k in c else "-"
                                                      for k in ("safetensors", "fastsafetensors", "host_read")),
                     f"{c['baseline']['s'] / c['load_rank']['s']:.1f}x", gb(c["baseline"]["read_bytes"]),
                     gb(c["load_rank"]["read_bytes"]),
                     f"{c['load_rank']['read_bytes'] / max(1, c['baseline']['read_bytes']):.3f}"])
    return rows


def section() -> str:
    run = inputs()
    w = run["sizes"][-1]["warm"]
    host = [s["warm"]["host_read"]["s"] / s["warm"]["load_rank"]["s"] for s in run["sizes"]]
    m = run["machine"]
    header = ["rank GB / checkpoint GB", *(f"{c} ms (GB/s)" for c in WARM_COLUMNS), "speedup vs baseline",
              "load / pinned H2D", "load / host_read"]
    return f"""## One rank in one process: the host's paths to the GPU (bench_load.py)

Repeated calls in one process, so not the first-call method above: what this section measures is
the paths themselves, which the first-call sections take as their limits. `benchmarks/bench_load.py`
on an {run['device']} ({m['cpus']} CPUs, torch {m['torch']}), one rank (rank {run['rank']} of EP
{run['ep_size']}) of Flash-dims checkpoints with 1, 2 and 4 MoE layers of 256 experts. **baseline**
reads every source shard the way vLLM's iterator does, keeps the rank's experts, stacks w1/w3, widens
the scales and transforms on the GPU; **load_rank** is `load_rank(out, rank, device="cuda")`;
**h2d_pinned** copies one pinned host buffer of the rank's bytes (the PCIe limit); **h2d_pageable**
the same from ordinary memory; **safetensors** is `safe_open(device="cuda")` of the rank's converted
files; **fastsafetensors** (0.5.0, no GDS) the same; **host_read** the rank's files from the page
cache into pinned buffers (the loader's threads and pieces, no device copy). Every `load_rank` result
equals the baseline's tensors (values, dtypes, shapes, strides): `all_correct = {run['all_correct']}`.

### Warm (files in the page cache), median of 5

{table(header, warm_rows(run))}

### Cold (page cache dropped before each run), seconds and bytes read from disk

{table(["rank GB / checkpoint GB", "baseline s", "load_rank s", "safetensors s", "fastsafetensors s", "host_read s",
        "speedup", "baseline GB read", "load_rank GB read", "read fraction"], cold_rows(run))}

### Why the warm limit is the page cache -> pinned copy, not pinned H2D

Pinned H2D runs at {w['h2d_pinned']['gb_per_s']:.0f} GB/s, but the bytes first have to get from the page
cache into pinned memory, a CPU memory copy: `host_read`, that copy alone, peaks at
{w['host_read']['gb_per_s']:.0f} GB/s ({w['host_read']['s'] / w['h2d_pinned']['s']:.1f}x the H2D time). `load_rank`
overlaps its device copies with those reads and runs at {max(host):.2f}x of `host_read` at the largest size:
host memory bandwidth bounds it, not PCIe. The routes around the CPU copy do not help on this machine:

- **Registering the page cache itself** (`cudaHostRegister` of the mapped file, so the copy engine
  reads the page cache): pinning the pages costs more than copying them, for whole files, chunks and
  1-16 threads alike (`benchmarks/probe_register.py`):

```
{result_text('probe-register-h100.log')}
```

- **GPUDirect Storage** (cuFile, fastsafetensors with GDS) reads from NVMe straight into GPU
  memory; that machine has no GDS (fastsafetensors ran with `nogds=True`, through host memory).
  Cold, all readers are disk-bound and equal (`load_rank` ~ `host_read` ~ safetensors ~
  fastsafetensors): the gain there is reading 1/{run['ep_size']} of the bytes.
"""


def plot(ax: Any, run: dict[str, Any]) -> None:
    """The load half of benchmarks.png: one rank's warm load against the checkpoint's size."""
    x = [s["source_bytes"] / GB for s in run["sizes"]]
    for key, label, style in (("baseline", "vLLM-style baseline", "o-"), ("load_rank", "load_rank", "s-"),
                              ("host_read", "host read only (page cache -> pinned)", "^:"),
                              ("h2d_pinned", "pinned H2D only", "v:")):
        ax.plot(x, [s["warm"][key]["s"] for s in run["sizes"]], style, label=label)
    ax.set(xlabel="checkpoint size (GB); one rank of EP 8", ylabel="seconds (warm)", yscale="log",
           title=f"Load one rank ({run['device']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
