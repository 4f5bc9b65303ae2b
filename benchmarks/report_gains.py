"""The lead of docs/benchmarks.md: what a node gains. First its whole start, process start to a loaded
model (benchmarks/results/boot-*/boot.json, saved by benchmarks/bench_boot.py), then its expert loading
alone, per shape, from the newest node run of each node size (benchmarks/results/node-*/node.json, saved
by benchmarks/bench_node.py)."""

from __future__ import annotations

from typing import Any

import report_boot
from common import short_gpu, table
from report_node import (
    COMMAND,
    NAMES,
    OURS,
    _scaled,
    by_shape,
    ceilings,
    expert_bytes,
    newest_first,
    shape_label,
    unprimed,
    wall,
)

FEWER = "†"


def node_name(result: dict[str, Any]) -> str:
    gpus = result["machine"]["gpus"]
    return f"{len(gpus)} x {short_gpu(gpus[0])}" if gpus else "CPU"


def first_steps(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One step per shape, in the order the run took them."""
    seen: dict[str, dict[str, Any]] = {}
    for step in result["steps"]:
        seen.setdefault(step["shape"], step)
    return list(seen.values())


def gain_rows(result: dict[str, Any]) -> list[str]:
    """The table rows of one run: per shape that megamoe and `auto` both ran, cold and warm; a median over
    fewer rounds than the shape ran is marked."""
    lines, node = [], node_name(result)
    shapes = by_shape(result)
    for step in first_steps(result):
        rows = shapes[step["shape"]]
        rounds = sum(1 for s in result["steps"] if s["shape"] == step["shape"])
        disk, ceiling = ceilings(rows)
        limits = {"cold": (disk, "the disk's parallel read"),
                  "warm": (ceiling, "the page cache -> pinned -> device pipeline" if _scaled(rows, "pipe", "warm")
                           else "its two halves timed apart (a bound)")}
        first = True
        for cache in ("cold", "warm"):
            got = {f: [r for r in rows.get((f, cache), []) if "node_wall_s" in r] for f in ("auto", *OURS)}
            if not all(got.values()):
                continue
            digits = 2 if cache == "cold" else 3

            def cell(form: str, digits: int = digits, got: dict = got, rounds: int = rounds) -> str:
                return f"{wall(got[form]):.{digits}f}" + (FEWER if len(got[form]) < rounds else "")

            ours, auto = [wall(got[f]) or 0.0 for f in OURS], wall(got["auto"]) or 0.0
            limit, what = limits[cache]
            shape = (f"{shape_label(step)}; {(expert_bytes(rows) or 0) / 1e9:.1f} GB of experts; "
                     f"{rounds} round{'s' if rounds > 1 else ''}") if first else ""
            cells = [node if first else "", shape, cache, " / ".join(cell(f) for f in OURS), cell("auto"),
                     " / ".join(f"{auto / t:.1f}x" for t in ours),
                     f"{what}: {limit:.{digits}f} s" if limit else "not measured",
                     " / ".join(f"{limit / t:.2f}x" for t in ours) if limit else "-"]
            lines.append("| " + " | ".join(cells) + " |")
            first = False
    return lines


def other_forms(name: str, result: dict[str, Any]) -> str:
    """The run's other load formats and the engine restart, at its first shape, beside `auto`."""
    step = first_steps(result)[0]
    rows = by_shape(result)[step["shape"]]
    cells = []
    for form in result["forms"]:
        if form in OURS:
            continue
        if form == "ipc_cache":
            t = wall(rows.get((form, "restart"), []))
            cells += [f"{NAMES[form]}: {t:.3f} s"] if t else []
            continue
        cold, warm = (wall(rows.get((form, c), [])) for c in ("cold", "warm"))
        if cold or warm:
            cells.append(f"{NAMES[form]} " + " / ".join(f"{t:.2f}" if t else "-" for t in (cold, warm)) + " s")
    if len(cells) < 3:
        return ""
    return (f"The other load formats on {node_name(result)}, {shape_label(step)} (`{name}`), cold / warm: "
            + "; ".join(cells) + ".")


def whole_start() -> str:
    """Each boot run's shapes at their most MoE layers: how many seconds sooner the node holds a loaded
    model with ``megamoe`` than with the engine's ``auto``, the share of ``auto``'s start that is, and the
    share that is ``auto``'s expert loading and its imports (which stay); a table per engine."""
    found = report_boot.runs()
    engines = sorted({report_boot.engine_of(run) for _, run in found}, key=lambda e: e.name != "vLLM")
    texts = [text for e in engines if (text := engine_start([(n, r) for n, r in found
                                                             if report_boot.engine_of(r) == e], e))]
    if not texts:
        return ""
    return "\n".join(texts) + (f"\n{estimate}\n" if (estimate := report_boot.whole_model(found)) else "")


def engine_start(found: list[tuple[str, dict[str, Any]]], engine: report_boot.Engine) -> str:
    """:func:`whole_start`'s table of one engine's runs."""
    rows = []
    for name, run in found:
        got = report_boot.cells(run)
        setup = {i["name"]: i for i in run["setup"]}
        shapes = {s for s, _, _ in got}
        both = {s for s in shapes if any((s, "megamoe", c) in got for c in ("cold", "warm"))}
        for shape in sorted(both or shapes, key=lambda s: -setup[s]["layers"])[:1]:
            info = setup[shape]
            for cache in ("cold", "warm"):
                auto, ours = got.get((shape, "auto", cache)), got.get((shape, "megamoe", cache))
                if not auto:
                    continue
                base = report_boot.node_s(auto)
                experts = report_boot.slowest(auto, "weights_experts_s")
                imports = report_boot.slowest(auto, "imports")
                mine = report_boot.node_s(ours) if ours else None
                rows.append([report_boot.node_of(run), f"{report_boot.shape_label(run, info)}, {info['layers']} MoE layers",
                             cache, f"{mine:.1f}" if mine is not None else "not run", f"{base:.1f}",
                             f"{base - mine:.1f} s ({(base - mine) / base:.0%})" if mine is not None else "-",
                             f"{experts:.1f} s ({experts / base:.0%})", f"{imports:.1f} s ({imports / base:.0%})",
                             f"`{name}`"])
    if not rows:
        return ""
    return ("Process start to a loaded model, every rank process of the node at once, one per GPU (where the "
            "node names more rank processes than GPUs, they share the GPUs in turn: a node of that many GPUs as its "
            "disk and page cache see it), through "
            f"{engine.label}'s real `{engine.model}` ({engine.dims} at the layers named), `--load-format megamoe` "
            f"against {engine.label}'s own `auto` in the same run (`bench_boot.py`; the slowest rank, medians over "
            "the rounds):\n\n" + table(["node", "shape", "cache", "`megamoe` s", f"{engine.label} `auto` s",
                                       "sooner (of `auto`'s start)", "`auto`'s expert loading", "`auto`'s imports",
                                       "run"], rows)
            + "\n\nWhere the experts are a few percent of the start, the forms differ by less than the imports vary "
              "from one start to the next (each run's section below gives every rank's phases).\n")


def gains() -> str:
    """The page's lead: what a node gains, per shape, from the newest run of each node size, each figure
    beside vLLM's `auto` and the limit measured in the same run."""
    runs, done = newest_first(), set()
    lines = ["| node | shape (node's experts, rounds) | cache | `megamoe` per-rank / store s | vLLM 0.33 `auto` s "
             "| megamoe vs `auto` | the limit measured beside it | megamoe vs the limit |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    notes = []
    for name, result in runs:
        if node_name(result) in done or result.get("layout_probe") is False:  # a diagnostic: not how it serves
            continue
        done.add(node_name(result))
        got = gain_rows(result)
        lines += got
        m = result["machine"]
        facts = [f"{m['gpus'][0]}, {m['cpus']} CPUs, one process per GPU"]
        if not any("batch" in row for step in result["steps"] for row in step["rows"]):
            facts.append("its measurements not batched (the next one's processes imported beside each)")
        if result.get("warm_reads", 1) < 2:
            facts.append("a warm row's files read once before it" + (
                ", and its warm rows that ran right after their files' first read left out of the medians "
                "(its section names them)" if unprimed(result) else ""))
        if got:
            notes.append(f"- {node_name(result)} (`{name}`): " + "; ".join(facts) + ".")
        if other := other_forms(name, result):
            notes.append(f"- {other}")
    if len(lines) == 2:
        return f"Not measured yet: run {COMMAND} on a machine of several GPUs."
    if any(FEWER in line for line in lines):
        notes.append(f"- {FEWER} a median of fewer rounds than the shape ran (a row set apart, or a form that did "
                     "not run in every round): its section's table says which.")
    start = whole_start()
    return ((f"### The whole start\n\n{start}\n### Expert loading alone\n\n" if start else "")
            + "Every rank process of a node released at once, one per GPU, into vLLM 0.33's real modules (Flash dims "
            "cut to the layers named), first load, medians over the rounds; each ratio against the figure beside it "
            "from the same run:\n\n" + "\n".join(lines) + "\n\n" + "\n".join(notes))
