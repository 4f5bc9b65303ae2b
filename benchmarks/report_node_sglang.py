"""The SGLang node section of docs/benchmarks.md (from benchmarks/results/sglang-node-*/node.json, saved
by ``benchmarks/bench_node.py --engine sglang``): SGLang 0.5.23's own loading beside megamoe, every
rank of a node at once."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from report_node import by_shape, ceilings, expert_bytes, halves, shape_label, wall, why

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = {"auto": "SGLang `auto`", "presharded_dump": "SGLang `presharded`, first run (loads, dumps)",
         "presharded": "SGLang `presharded`, reload", "megamoe_per_rank": "`megamoe`, per-rank form",
         "megamoe_store": "`megamoe`, store", "ipc_cache": "restart, SGLang's daemons (loaded from the source)",
         "ipc_cache_megamoe": "restart, `megamoe preload`'s daemons"}
RESTARTS = ("ipc_cache", "ipc_cache_megamoe")
COMMAND = ("`benchmarks/device_node.sh sglang-setup && benchmarks/device_node.sh sglang-job 300`, then "
           "`benchmarks/device_node.sh sglang-wait DEST`")
HEAD = """## A whole node at once: SGLang 0.5.23's real loading code beside megamoe (bench_node.py --engine sglang)

`benchmarks/bench_node.py --engine sglang` runs the node benchmark above (the same rank processes,
release, batches, ceilings and page-cache handling) on SGLang 0.5.23's Hopper path: each rank builds
SGLang's real model class of the family with its `FusedMoE` experts on its GPU
(`tests/engines/sglang_fp8_harness.py`: SGLang's topology for `--moe-a2a-backend megamoe`, only the SM90
platform check patched; SGLang's modules imported as on a machine without CUDA, so none of its compiled
kernels are imported, their tensors on the GPU), FP8 128x128 block-quantized experts whose
post-processing is SGLang's own `build_sm90_mega_moe_experts_weights`. It times the first load of:
SGLang's `DefaultModelLoader` (`--load-format auto`, its multi-threaded safetensors iterator over the
source); `--load-format presharded`'s first run (no dump yet: it loads as `auto` does, then hashes and
writes the rank's post-processed tensors) and its reload from that dump (each rank dumps into its own
folder as a world of one: the rank processes are not one process group, and no expert tensor is shared
between ranks); an engine restart mapping what one weight-cache daemon per rank holds over CUDA IPC
(SGLang's `IpcModelLoader` and its daemon's export and serve loop: daemons loaded from the source by
SGLang's `DefaultModelLoader`, and daemons that installed the per-rank form as `megamoe preload`'s do,
mapped with megamoe-convert's hooks); and `megamoe`, `install()` from the per-rank form and from the
store. Every ratio divides two figures of this run: SGLang's `auto` and the limits measured beside it.
The kernel's bytes (`w13/w2_weight` and their scales, which `mega_l1_weights` / `mega_l2_weights`
alias) are checked equal across the forms, rank by rank; the last column says whether each form left
the modules holding those tuples, which the SM90 forward hands the kernel. `--quick` runs it tiny on
the CPU (`tests/e2e/test_benchmarks.py`); on a GPU machine, {COMMAND}.
""".replace("{COMMAND}", COMMAND)


def load_all() -> list[tuple[str, dict[str, Any]]]:
    return [(p.parent.name, json.loads(p.read_text())) for p in sorted(RESULTS.glob("sglang-node-*/node.json"))]


def tuples(rows: list[dict[str, Any]]) -> str:
    got = {r.get("kernel_tuples") for row in rows for r in row.get("ranks", []) if "kernel_tuples" in r}
    return "-" if not got else "yes" if got == {True} else "no" if got == {False} else "some"


def written(rows: list[dict[str, Any]]) -> str:
    got = [sum(r.get("written_bytes", 0) for r in row.get("ranks", [])) for row in rows if "ranks" in row]
    return f"; dumped {statistics.median(got) / 1e9:.2f} GB" if got and max(got) else ""


def table(rows: dict[tuple[str, str], list[dict[str, Any]]], forms: list[str]) -> str:
    """One shape: each form's node time cold and warm, against SGLang's `auto` and the limits."""
    disk, ceiling = ceilings(rows)
    base = {c: wall(rows.get(("auto", c), [])) for c in ("cold", "warm")}
    lines = ["| form | cold: node s | cold: x of disk | cold: vs SGLang `auto` | cold: GB read | warm: node s "
             "| warm: x of ceiling | warm: vs SGLang `auto` | MegaMoE tuples after load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for form in forms:
        if form in RESTARTS:
            got = rows.get((form, "restart"), [])
            t, warm_base = wall(got), base["warm"]
            vs = f"{warm_base / t:.1f}x" if t and warm_base else "-"
            lines.append(f"| {NAMES[form]} | - | - | - | 0 | {f'{t:.3f}' if t else why(got)} | - | {vs} | {tuples(got)} |")
            continue
        cold, warm = rows.get((form, "cold"), []), rows.get((form, "warm"), [])
        tc, tw = wall(cold), wall(warm)
        gb = [x["read_bytes"] for x in cold if "read_bytes" in x]
        cells = [f"{tc:.2f}{written(cold)}" if tc else why(cold), f"{disk / tc:.2f}x" if tc and disk else "-",
                 f"{base['cold'] / tc:.2f}x" if tc and base["cold"] else "-",
                 f"{statistics.median(gb) / 1e9:.2f}" if gb else "-", f"{tw:.3f}" if tw else why(warm),
                 f"{ceiling / tw:.2f}x" if tw and ceiling else "-",
                 f"{base['warm'] / tw:.2f}x" if tw and base["warm"] else "-", tuples(cold + warm)]
        lines.append(f"| {NAMES[form]} | " + " | ".join(cells) + " |")
    bound = halves(rows)
    lines.append(f"| the limits: the disk's parallel read (cold); page cache -> pinned -> device (warm) | "
                 f"{f'{disk:.2f}' if disk else '-'} | 1.00x | | | {f'{ceiling:.3f}' if ceiling else '-'} | 1.00x | | |")
    if bound is not None and bound != ceiling:
        lines.append(f"| warm bound: its halves timed apart (not reachable together) | | | | | {bound:.3f} | | | |")
    return "\n".join(lines)


def section() -> str:
    runs = load_all()
    if not runs:
        return HEAD + f"\nNot measured yet: run {COMMAND} on a machine of several GPUs.\n"
    parts = [HEAD]
    for name, result in runs:
        m, preset = result["machine"], result.get("preset", "?")
        parts.append(f"\n### {name}: {len(m['gpus'])} x {m['gpus'][0] if m['gpus'] else 'CPU'}, {m['cpus']} CPUs, "
                     f"{m['rank_processes']} rank processes, OpenMP threads {m['omp_threads']}, torch {m['torch']}; "
                     f"`{preset}` dims\n")
        shapes, seen = by_shape(result), set()
        for step in result["steps"]:
            if step["shape"] in seen:
                continue
            seen.add(step["shape"])
            rows = shapes.get(step["shape"], {})
            rounds = sum(1 for s in result["steps"] if s["shape"] == step["shape"])
            nbytes = expert_bytes(rows)
            size = f"{nbytes / 1e9:.2f} GB of routed experts for the node" if nbytes else "no megamoe row"
            parts.append(f"\n#### {shape_label(step)}: {size}, {rounds} round(s)\n\n{table(rows, result['forms'])}\n")
        same = result.get("identical") or {}
        parts.append(f"\nIdentical kernel bytes across forms (per shape and rank): "
                     f"{all(same.values()) if same else 'not checked'}.\n")
    return "".join(parts)
