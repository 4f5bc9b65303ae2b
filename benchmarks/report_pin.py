"""docs/benchmarks.md's section on what pinning the staging ring costs a rank's start, from
``benchmarks/results/pin-*/pin.json`` (``bench_pin.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench_pin import summary
from common import short_gpu, table

RESULTS = Path(__file__).resolve().parent / "results"
#: How each mode reaches the GPU, in words.
MODES = {"fast": "huge pages registered with CUDA by several threads (`MEGAMOE_FAST_PIN=1`)",
         "torch": "torch's pinned allocator (`MEGAMOE_FAST_PIN=0`)"}


def load_all() -> list[tuple[str, dict[str, Any]]]:
    return [(p.parent.name, json.loads(p.read_text())) for p in sorted(RESULTS.glob("pin-*/pin.json"))]


def mode_label(mode: str, buffers: int) -> str:
    """``buffers``: the ring's (the engines' own is sized by whether the load is cold)."""
    method, _, count = mode.partition(":")
    if method == "pageable":
        return "no ring: the file read into ordinary memory, copied to the GPU"
    size = f"{buffers} x 16 MB ring ({buffers * 16} MB)"
    return f"{size}, {MODES.get(method, method)}" + ("" if count else ", sized as the engines size it")


def run_section(name: str, result: dict[str, Any]) -> str:
    m = result["machine"]
    gpus = f"{len(m['gpus'])} x {short_gpu(m['gpus'][0])}" if m["gpus"] else "CPU"
    rounds = len({r["round"] for r in result["rows"]})
    rows = [[mode_label(got["mode"], got["ring_buffers"]), got["cache"], f"{got['build_s']:.3f}", f"{got['build_over_pageable_s']:+.3f}"
             if "build_over_pageable_s" in got else "-", f"{got['pin_s']:.3f}", f"{got['load_s']:.3f}",
             f"{got['total_s']:.3f}", f"{got['slowest_total_s']:.3f}"]
            for got in summary(result["rows"])]  # from the rows: a run before caches were measured was warm
    failed = [f"- `{r['mode']}` round {r['round']}: {r['failed']}" for r in result["rows"] if "failed" in r]
    ok = all(x["bytes_ok"] for r in result["rows"] for x in r.get("ranks", []))
    return (f"\n### {name}: {gpus}, {m['cpus']} CPUs, {m['rank_processes']} rank processes at once, OpenMP threads "
            f"{m['omp_threads']}, torch {m['torch']}; {result['load_bytes'] / 1e9:.2f} GB a rank, {rounds} round(s)\n\n"
            + table(["how the bytes reach the GPU", "page cache", "build s", "build over no ring s", "ring pinned s",
                     "load s", "build + load s", "slowest rank's build + load s"], rows)
            + ("\n\n" + "\n".join(failed) if failed else "")
            + (f"\n\n{result['note']}" if result.get("note") else "")
            + f"\n\nEvery load's bytes matched its file: {'yes' if ok else 'NO'}.\n")


def section() -> str:
    head = """## The staging ring's pinning at start-up (bench_pin.py)

`benchmarks/bench_pin.py` starts one process per GPU, all at once, as a node's ranks start. Each
times, from its CUDA context on, a model-build-like loop (288 parameters of 1-48 MB allocated on its
GPU, layer by layer) while megamoe's staging ring is pinned on a thread as the loaders start it,
then one load of its file through the ring, warm (the file in the page cache) or cold (the page
cache dropped first); for reference, the same without a ring (the file read into ordinary memory and
copied to the GPU). A ring with fewer buffers than two a lane is cut in parts, every lane owning two
pieces (a run's note says where its lanes did not). The engines size their ring when they pin it:
16 MB a warm lane, twice that where the load will be cold or a rank's share is 8 GiB or more
(`serve/staging.py`'s `ring_buffers`); "sized as the engines size it" rows ran that. Medians over
ranks and rounds; "build over no ring" is what the pinning costs the engine's model build. `--smoke`
runs it on the CPU in CI.
"""
    runs = [(name, r) for name, r in load_all() if not r.get("smoke")]
    if not runs:
        return head + "\nNot measured yet: `python3 benchmarks/bench_pin.py --work DIR --save FILE` on a GPU machine.\n"
    return head + "".join(run_section(name, result) for name, result in runs)
