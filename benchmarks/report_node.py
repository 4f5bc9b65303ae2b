"""The node section of docs/benchmarks.md, and its headline (from benchmarks/results/node-*/node.json,
saved by benchmarks/bench_node.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from node_forms import files_read

RESULTS = Path(__file__).resolve().parent / "results"
#: The goals at node level: cold against the disk's parallel read, warm against the node's ceiling.
COLD_GOAL, WARM_GOAL = 0.9, 0.8
NAMES = {"auto": "vLLM `auto`", "auto_ep_filter": "vLLM `auto` + EP weight filter",
         "fastsafetensors": "vLLM `fastsafetensors`", "instanttensor": "vLLM `instanttensor`",
         "runai_streamer": "vLLM `runai_streamer`", "megamoe_per_rank": "`megamoe`, per-rank form",
         "megamoe_store": "`megamoe`, store", "ipc_cache": "`ipc_cache` restart (daemon up)"}
OURS = ("megamoe_per_rank", "megamoe_store")
COMMAND = ("`benchmarks/device_node.sh setup && benchmarks/device_node.sh job 900`, then "
           "`benchmarks/device_node.sh wait DEST`")
UNPROBED = ("A diagnostic run, not how megamoe serves: its installs ran with the layout probe switched off "
            "(`MEGAMOE_LAYOUT_PROBE=0`), to show what the probe costs a short load against the run of the same "
            "shapes with it on.")
UNBATCHED = ("This run's measurements were not batched: each ran while the next one's processes imported and "
             "built beside it, so its rows do not compare with a batched run's.")


def load_all() -> list[tuple[str, dict[str, Any]]]:
    return [(p.parent.name, json.loads(p.read_text())) for p in sorted(RESULTS.glob("node-*/node.json"))]


def unprimed(result: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(step, row) of each warm row that ran right after its files' first read into the page cache: a
    run that read a warm row's files once before it (``warm_reads`` 1, or not recorded) where no row
    that ran since the last drop had read them. Those rows are not comparable with the warm rows whose
    files were read before and read again (every warm row of a run with ``warm_reads`` 2), so they are
    shown apart and left out of the medians."""
    if result.get("warm_reads", 1) >= 2:
        return []
    found = []
    for step in result["steps"]:
        cached: set[str | None] = set()  # the files read since the last drop, as the rows ran
        for row in (r for r in step["rows"] if "node_wall_s" in r):  # a row that did not run read nothing
            files = files_read(row["form"])
            if row["cache"] == "cold":
                cached = {files}
            elif row["cache"] == "warm":
                if files not in cached and row["form"] != "h2d":  # h2d's timing reads no file
                    found.append((step, row))
                cached.add(files)
    return found


def by_shape(result: dict[str, Any], set_apart: bool = True) -> dict[str, dict[tuple[str, str], list[dict[str, Any]]]]:
    """shape -> (form, cache) -> its rows over the rounds (:func:`unprimed` rows left out, unless not ``set_apart``)."""
    apart = {id(row) for _, row in unprimed(result)} if set_apart else set()
    shapes: dict[str, dict[tuple[str, str], list[dict[str, Any]]]] = {}
    for step in result["steps"]:
        for row in step["rows"]:
            if id(row) not in apart:
                shapes.setdefault(step["shape"], {}).setdefault((row["form"], row["cache"]), []).append(row)
    return shapes


def method_notes(result: dict[str, Any]) -> str:
    """What a run did differently from the method described above, and its rows shown apart."""
    notes = []
    if not any("batch" in row for step in result["steps"] for row in step["rows"]):
        notes.append(UNBATCHED)
    once = "This run read a warm row's files once just before it (the method reads them twice)."
    if not (apart := unprimed(result)) and result.get("warm_reads", 1) < 2:
        notes.append(once)
    if apart:
        everything = by_shape(result, set_apart=False)  # the medians with the rows left out put back
        rows = "; ".join(f"`{step['shape']}` round {step['round']}, {NAMES.get(row['form'], row['form'])}: "
                         f"{row['node_wall_s']:.3f} s (with it, the median would be "
                         f"{wall(everything[step['shape']][row['form'], 'warm']):.3f} s)" for step, row in apart)
        notes.append(f"{once} Its warm rows that ran right after that first read (no row since the last drop had read "
                     f"those files) are left out of the medians, as not comparable with the rest: {rows}.")
    return "".join(f"\n{note}\n" for note in notes)


def warm_reads_table() -> str:
    """The warm rows of a run alternating one and two reads of their files before each row
    (``benchmarks/results/node-*-warm-reads/readsN-I.json``: N reads, I-th run), beside the pipe ceiling."""
    found = sorted(RESULTS.glob("node-*-warm-reads/reads*-*.json"),
                   key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    if not found:
        return ""
    lines = ["| run | warm reads before each row | `megamoe` per-rank s | `megamoe` store s | pipeline ceiling s |",
             "|---:|---:|---:|---:|---:|"]
    kinds = ("megamoe_per_rank", "megamoe_store", "pipe")
    times: dict[tuple[str, str], list[float]] = {}
    for path in found:
        result = json.loads(path.read_text())
        rows = {(row["form"], row["cache"]): [row] for step in result["steps"] for row in step["rows"]}
        got = {k: wall(rows.get((k, "warm"), [])) for k in kinds[:2]} | {"pipe": _scaled(rows, "pipe", "warm")}
        cells = [f"{got[k]:.3f}" if got.get(k) else "-" for k in kinds]
        reads, run = path.stem.removeprefix("reads").split("-")  # the reads are in the name too: older runs lack the key
        reads = str(result.get("warm_reads", reads))
        lines.append(f"| {run} | {reads} | " + " | ".join(cells) + " |")
        for k in kinds:
            if got.get(k):
                times.setdefault((reads, k), []).append(got[k])
    medians = "; ".join(f"{reads} read{'s' if reads != '1' else ''}: " + " / ".join(
        f"{statistics.median(times[reads, k]):.3f}" for k in kinds if (reads, k) in times) + " s"
        for reads in sorted({r for r, _ in times}))
    first = json.loads(found[0].read_text())
    step, m = first["steps"][0], first["machine"]
    return (f"\n#### One read or two before a warm row ({len(m['gpus'])} x {m['gpus'][0]}, "
            f"{shape_label(step)}, one round a run)\n\nFresh runs of `bench_node.py`, the page cache dropped before "
            "each (`for r in 1 2 1 2; do sync; echo 3 > /proc/sys/vm/drop_caches; benchmarks/device_node.sh run "
            "--layers 2 --rounds 1 --shapes node --caches warm --forms megamoe_per_rank,megamoe_store --batch 5 "
            "--warm-reads $r --save ...; done`), alternating one and two reads of a warm row's files just before it; "
            "the megamoe rows' files came from the disk with the first read, the ceiling's were read by the rows "
            "before it (the ceiling scaled to the experts' bytes, as above):\n\n" + "\n".join(lines) + f"\n\nMedians, per-rank form / store / "
            f"ceiling: {medians}.\n")


def wall(rows: list[dict[str, Any]]) -> float | None:
    times = [r["node_wall_s"] for r in rows if "node_wall_s" in r]
    return statistics.median(times) if times else None


def why(rows: list[dict[str, Any]]) -> str:
    for r in rows:
        for key in ("skipped", "failed"):
            if key in r:
                return f"{key}: {r[key].strip().splitlines()[-1][:140]}"
    return "-"


def expert_bytes(rows: dict[tuple[str, str], list[dict[str, Any]]]) -> float | None:
    """The node's routed-expert bytes (what its GPUs hold): recorded by the run, or else what the
    megamoe forms read cold (they read nothing else)."""
    for got in rows.values():
        for r in got:
            if "expert_bytes" in r:
                return r["expert_bytes"]
    reads = [r["read_bytes"] for f in OURS for r in rows.get((f, "cold"), []) if "read_bytes" in r]
    return statistics.median(reads) if reads else None


def ceilings(rows: dict[tuple[str, str], list[dict[str, Any]]]) -> tuple[float | None, float | None]:
    """Seconds the node's disk takes for its expert bytes (cold: the faster of one reader of the node's
    files and every rank reading its own at once), and its page cache -> pinned -> device ceiling for
    them (warm: every rank's files through pinned buffers to its GPU as one pipeline; a run without
    it, the slower of the two halves timed apart). The ceilings move the rank files whole: their
    times are scaled to the expert bytes."""
    disk = _fastest(_scaled(rows, kind, "cold") for kind in ("disk_read", "disk_read_ranks"))
    pipe = _scaled(rows, "pipe", "warm")
    return disk, pipe if pipe is not None else halves(rows)


def halves(rows: dict[tuple[str, str], list[dict[str, Any]]]) -> float | None:
    """The slower of the warm path's halves timed apart (every rank reading into pinned memory; every
    rank copying pinned memory to its GPU): a bound no pipeline reaches, since together they share
    the host's memory bus."""
    host, h2d = _scaled(rows, "host_read", "warm"), _scaled(rows, "h2d", "warm")
    return max(host, h2d) if host is not None and h2d is not None else None


def _fastest(times: Any) -> float | None:
    got = [t for t in times if t is not None]
    return min(got) if got else None


def _scaled(rows: dict[tuple[str, str], list[dict[str, Any]]], kind: str, cache: str) -> float | None:
    """A ceiling's median node time, scaled from the rank files it moved to the node's expert bytes."""
    experts = expert_bytes(rows)
    got = [r for r in rows.get((kind, cache), []) if "node_wall_s" in r]
    if not got or not experts:
        return None
    return statistics.median(r["node_wall_s"] * experts / r.get("bytes_moved", r.get("node_bytes")) for r in got)


def shape_label(step: dict[str, Any]) -> str:
    n, ep = step["ranks"], step["ep_size"]
    where = "one node holds every rank" if n == ep else f"one node of {ep // n}: ranks 0-{n - 1}"
    return f"{where} (EP {ep}), {step['layers']} MoE layers"


def shape_table(rows: dict[tuple[str, str], list[dict[str, Any]]], forms: list[str], rounds: int = 1,
                ) -> tuple[str, dict]:
    """The shape's table (a form's time that rests on fewer of the ``rounds`` says on how many) and its ratios."""
    disk, ceiling = ceilings(rows)

    def of(rs: list[dict[str, Any]]) -> str:
        n = sum(1 for x in rs if "node_wall_s" in x)
        return f" ({n} of {rounds} rounds)" if n < rounds else ""

    base = {c: wall(rows.get(("auto", c), [])) for c in ("cold", "warm")}
    lines = ["| form | cold: node s | cold: x of disk | cold: vs `auto` | cold: GB read | warm: node s "
             "| warm: x of ceiling | warm: vs `auto` | slowest rank cold / warm s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios: dict[str, dict[str, float]] = {}
    for form in forms:
        if form == "ipc_cache":
            got = rows.get((form, "restart"), [])
            t = wall(got)
            cells = ["-", "-", "-", "0", f"{t:.3f}" if t else why(got), "-", "-",
                     f"- / {max(r['slowest_rank_s'] for r in got if 'slowest_rank_s' in r):.3f}" if t else "-"]
            lines.append(f"| {NAMES[form]} | " + " | ".join(cells) + " |")
            continue
        cold, warm = rows.get((form, "cold"), []), rows.get((form, "warm"), [])
        tc, tw = wall(cold), wall(warm)
        r = ratios.setdefault(form, {})
        if tc and disk:
            r["cold_vs_disk"] = disk / tc
        if tw and ceiling:
            r["warm_vs_ceiling"] = ceiling / tw
        if tc and base["cold"]:
            r["cold_vs_auto"] = base["cold"] / tc
        if tw and base["warm"]:
            r["warm_vs_auto"] = base["warm"] / tw
        gb = statistics.median(x["read_bytes"] for x in cold if "read_bytes" in x) / 1e9 if tc else None
        slow = [statistics.median(x["slowest_rank_s"] for x in rs if "slowest_rank_s" in x) if wall(rs) else None
                for rs in (cold, warm)]
        cells = [f"{tc:.2f}{of(cold)}" if tc else why(cold), f"{r['cold_vs_disk']:.2f}x" if "cold_vs_disk" in r else "-",
                 f"{r['cold_vs_auto']:.2f}x" if "cold_vs_auto" in r else "-", f"{gb:.2f}" if gb is not None else "-",
                 f"{tw:.3f}{of(warm)}" if tw else why(warm), f"{r['warm_vs_ceiling']:.2f}x" if "warm_vs_ceiling" in r else "-",
                 f"{r['warm_vs_auto']:.2f}x" if "warm_vs_auto" in r else "-",
                 " / ".join(f"{s:.3f}" if s else "-" for s in slow)]
        lines.append(f"| {NAMES[form]} | " + " | ".join(cells) + " |")
    if disk or ceiling:
        lines.append("| ceilings: the disk's parallel read (cold); page cache -> pinned -> device (warm) | "
                     + (f"{disk:.2f} | 1.00x" if disk else "not measured | -") + " | | | "
                     + (f"{ceiling:.3f} | 1.00x" if ceiling else "not measured | -") + " | | |")
    else:
        lines.append("| ceilings | not measured | | | | | | | |")
    if (bound := halves(rows)) is not None and bound != ceiling:
        lines.append(f"| warm bound: its halves timed apart (not reachable together) | | | | | {bound:.3f} "
                     f"| {ceiling / bound:.2f}x | | |" if ceiling else "")
    return "\n".join(lines), ratios


def growth(result: dict[str, Any], forms: list[str]) -> str:
    """Each form's node time at each layer count, per shape kind and cache."""
    shapes = by_shape(result)
    layers = sorted({s["layers"] for s in result["steps"]})
    if len(layers) < 2:
        return (f"How each form's time grows with the MoE layers: not measured in this run (it timed {layers[0]} "
                f"layers only; `--layers 8,2` times both).")
    lines = ["| form | shape | cache | " + " | ".join(f"{n} layers s" for n in layers) + " | per added layer s |",
             "|---|---|---|" + "---:|" * (len(layers) + 1)]
    for form in forms:
        for kind in ("node", "slice"):
            for cache in (("restart",) if form == "ipc_cache" else ("cold", "warm")):
                times = [wall(shapes.get(f"{kind}-l{n}", {}).get((form, cache), [])) for n in layers]
                if None in times:
                    continue
                per_layer = (times[-1] - times[0]) / (layers[-1] - layers[0])
                lines.append(f"| {NAMES[form]} | {kind} | {cache} | " + " | ".join(f"{t:.3f}" for t in times)
                             + f" | {per_layer:.3f} |")
    return "\n".join(lines)


def section() -> str:
    head = """## A whole node at once: vLLM 0.33's real loading code, every load format (bench_node.py)

`benchmarks/bench_node.py` starts one process per GPU; each builds vLLM 0.33's real
`DeepGemmMegaMoEExperts` modules on its GPU (through `tests/engines/vllm_harness.py`: only the SM100
check and the process groups patched) and times its first load: vLLM's own loader for
`--load-format auto` (with and without `--enable-ep-weight-filter`), `fastsafetensors`,
`instanttensor` and `runai_streamer` over the source checkpoint; `megamoe` from the per-rank form
and from the store (`install()`, the staging started when the loader is made); and an engine restart
through `--load-format ipc_cache` mapping what one weight-cache daemon per rank holds. Threads: each
rank loads with its share of the CPUs, as a vLLM 0.33 worker does. A batch's processes import and
build together, then its measurements run one at a time, each on a quiet host. Node time: from the
release to the last rank's end. The limits, timed in the same rounds: the disk's parallel read of
the node's bytes (cold: the faster of one process reading the node's files, 64 threads x 4 MB, and
every rank reading its own at once, 32 threads x 4 MB each) and the node's page cache -> pinned ->
device pipeline with every rank at once (warm: each rank's files through pinned buffers to its GPU,
16 threads x 16 MB double-buffered, the loader's shape with nothing of a loader's work; the table
also gives its two halves timed apart, every rank reading into pinned memory and every rank copying
pinned memory to its GPU, a bound no pipeline reaches since together they share the host's memory
bus). Every ratio is against the node's routed-expert bytes (what its GPUs hold; the limits read the
rank files whole, fused shared expert included, and their times are scaled to those bytes). The
forms' order within a round: vLLM's `auto` and megamoe first, the limits next, the other loaders
last. On virtual machines the host may still cache what was written or read in the last minutes,
whatever `drop_caches` does inside, which favours the form whose files were touched last: more
rounds average that out. `fastsafetensors` falls back to its copier without GDS where the machine
has no `/dev/nvidia-fs0`; it and `instanttensor` read the whole checkpoint in every rank process past
the page cache (the GB read column). `--quick` runs it tiny on the CPU (`tests/e2e/test_benchmarks.py`);
on a GPU machine, {COMMAND}.
""".replace("{COMMAND}", COMMAND)
    runs = newest_first()
    if not runs:
        return head + f"\nNot measured yet: run {COMMAND} on a machine of several GPUs.\n"
    parts = [head]
    for name, result in runs:
        m = result["machine"]
        parts.append(f"\n### {name}: {len(m['gpus'])} x {m['gpus'][0] if m['gpus'] else 'CPU'}, {m['cpus']} CPUs, "
                     f"{m['rank_processes']} rank processes, OpenMP threads {m['omp_threads']}, torch {m['torch']}\n")
        if result.get("layout_probe") is False:
            parts.append(f"\n{UNPROBED}\n")
        shapes = by_shape(result)
        left_out = [step["shape"] for step, _ in unprimed(result)]
        seen = set()
        for step in result["steps"]:
            if step["shape"] in seen:
                continue
            seen.add(step["shape"])
            rounds = sum(1 for s in result["steps"] if s["shape"] == step["shape"])
            table, _ = shape_table(shapes[step["shape"]], result["forms"], rounds)
            left = left_out.count(step["shape"])
            nbytes = expert_bytes(shapes[step["shape"]])
            size = f"{nbytes / 1e9:.2f} GB of routed experts for the node" if nbytes else "no megamoe row"
            apart = f", {left} warm row(s) of them left out (below)" if left else ""
            parts.append(f"\n#### {shape_label(step)}: {size}, {rounds} round(s){apart}\n\n{table}\n")
        table = growth(result, result["forms"])
        parts.append(f"\n{table}\n" if table.startswith("How") else
                     f"\nHow each form's node time grows with the MoE layers:\n\n{table}\n")
        parts.append(method_notes(result))
        parts.append(goal_lines(result))
        parts.append(f"\nIdentical kernel bytes across forms (per shape and rank): "
                     f"{all(result.get('identical', {}).values()) if result.get('identical') else 'not checked'}.\n")
    parts.append(warm_reads_table())
    return "".join(parts)


def goal_parts(ratios: dict[str, float]) -> str:
    """A form's ratios against the goals, each cache whose form and ceiling both ran ('' where neither)."""
    parts = []
    if "cold_vs_disk" in ratios:
        cold = ratios["cold_vs_disk"]
        parts.append(f"cold {cold:.2f}x of the disk's parallel read (goal {COLD_GOAL}x: "
                     f"{'met' if cold >= COLD_GOAL else '**not met**'})")
    if "warm_vs_ceiling" in ratios:
        warm = ratios["warm_vs_ceiling"]
        parts.append(f"warm {warm:.2f}x of the node's ceiling (goal {WARM_GOAL}x: "
                     f"{'met' if warm >= WARM_GOAL else '**not met**'})")
    return ", ".join(parts)


def goal_lines(result: dict[str, Any]) -> str:
    """Whether the megamoe forms reach the node's limits, shape by shape (the largest checkpoint's
    shapes are the goals'; the smaller ones' show how far a shorter load gets)."""
    lines = []
    top = max(s["layers"] for s in result["steps"])
    for shape, rows in by_shape(result).items():
        disk, _ = ceilings(rows)
        _, ratios = shape_table(rows, result["forms"])
        got = {f: ratios.get(f, {}) for f in OURS}
        smaller = "" if shape.endswith(f"-l{top}") else " (a smaller checkpoint)"
        judged = [(form, part) for form, r in got.items() if (part := goal_parts(r))]
        if not judged:
            lines.append(f"- `{shape}`{smaller}: the megamoe forms or the ceilings beside them did not run before the "
                         "run's time was up: goals not measured for this shape.")
            continue
        lines += [f"- `{shape}`{smaller}, {NAMES[form]}: {part}." for form, part in judged]
        fastest = min((wall(r) or float("inf") for (f, c), r in rows.items()
                       if c == "cold" and f not in ("disk_read", "disk_read_ranks")), default=float("inf"))
        if disk and fastest < disk:
            lines.append(f"- `{shape}`: the disk ceiling's readers took {disk:.2f} s at best, "
                         f"slower than the fastest cold form ({fastest:.2f} s): the disk reads the node's bytes at "
                         f"least at {(expert_bytes(rows) or 0) / fastest / 1e9:.2f} "
                         "GB/s with more reads in flight, so a cold ratio above 1 says the ceiling reader, not the "
                         "disk, was the limit.")
    return "\nAt node level, against the limits measured beside them:\n\n" + "\n".join(lines) + "\n"


def started(result: dict[str, Any]) -> float:
    """When a run's first measurement began."""
    return min((r["start_unix"] for step in result["steps"] for row in step["rows"] for r in row.get("ranks", [])),
               default=0.0)


def newest_first() -> list[tuple[str, dict[str, Any]]]:
    return sorted(load_all(), key=lambda run: -started(run[1]))
