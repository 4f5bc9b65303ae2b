"""The store section of docs/benchmarks.md (from benchmarks/results/store-h100/ep*.json, saved by
benchmarks/bench_store.py; one file per EP size, each a run on one machine)."""

from __future__ import annotations

import json
import re
import statistics
from typing import Any

from common import RESULTS, short_gpu

FOLDER = RESULTS / "store-h100"
WARM_GOAL, COLD_GOAL = 0.8, 0.9

INTRO = r"""`benchmarks/bench_store.py` times, for rank 0 of each `--ep-sizes` (Flash dims, 2 MoE layers), the
first call in a fresh process filling the rank's preallocated device tensors from the store
(`serve.store.load_slots`) and from the per-rank form (`load_rank(..., into=)`), warm (median of
`--repeats` children after a warming one) and cold (`--cold`, median of the cold children), the forms
and the limits interleaved round-robin. The limits: `host_read` (the rank's bytes from the page cache
into pinned buffers, the loader's threads and pieces, its threads started before the clock as the
loader's are), `h2d_pinned`, and cold `disk_read` (the rank's ranges read cold by the fastest of the
reader shapes: the loader's warm and cold lanes' shapes and 64 threads x 4 MB). The warm first call
is timed three ways: the staging started early (as the engines' loaders and model classes start it,
before the model is built), ready before the call (all of its preparation done, as a real model's
build of seconds leaves it: the column "staging ready"), and not started; the cold call finds the
staging ready. It checks the two forms give the same bytes, and reports the on-disk expert bytes of
the store against the per-rank form's for all ranks. `--store-knobs` adds the store under other
`MEGAMOE_*` settings and `--baseline-tree DIR` the store from another checkout, timed in the same
rounds.

```bash
PYTHONPATH=. python3 benchmarks/bench_store.py --preset flash --layers 2 --ep-sizes 8 --no-last-rank --cold \
    --save benchmarks/results/store-h100/ep8.json   # on a GPU machine (as root for --cold)
PYTHONPATH=. python3 benchmarks/bench_store.py --quick   # CPU smoke run (tests/e2e/test_benchmarks.py)
```"""

HEADER = ["| EP | rank | rank GB | form | warm, staging started early (s) (of it waiting for it) | warm, staging ready "
          "(s) | warm, nothing started (s) | page cache -> pinned (s) | "
          "early vs ceiling | ready vs ceiling | cold (s) | disk read (s) | cold vs disk | same bytes |",
          "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
FORM_NAMES = {"per_rank": "per-rank", "store": "store", "store_baseline": "store, baseline tree"}


def _s(r: dict[str, Any], key: str, digits: int = 3) -> str:
    v = r.get(key)
    return f"{v['seconds']:.{digits}f}" if isinstance(v, dict) and "seconds" in v else "-"


def _x(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.2f}x" if key in r else "-"


def _form_name(form: str) -> str:
    """A form's row label; ``store MEGAMOE_A=1,...`` (``--store-knobs``) as ``store, `A=1 ...```."""
    if form in FORM_NAMES:
        return FORM_NAMES[form]
    kind, _, knobs = form.partition(" ")
    return f"{FORM_NAMES.get(kind, kind)}, `{knobs.replace('MEGAMOE_', '').replace(',', ' ')}`"


def _rows(r: dict[str, Any]) -> list[str]:
    """One line per form of one (EP size, rank) measurement."""
    lines = []
    for form in r.get("forms", FORM_NAMES):
        if f"{form}_warm" not in r:
            continue
        waited = r[f"{form}_warm"].get("waited_for_ring_s")
        early = _s(r, f"{form}_warm") + (f" ({waited * 1e3:.0f} ms)" if waited is not None else "")
        lines.append(f"| {r['ep_size']} | {r['rank']} | {r['bytes'] / 1e9:.2f} | {_form_name(form)} | {early} | "
                     f"{_s(r, f'{form}_warm_ready')} | {_s(r, f'{form}_warm_unprepared')} | {_s(r, 'host_read')} | "
                     f"{_x(r, f'{form}_warm_vs_ceiling')} | {_x(r, f'{form}_warm_ready_vs_ceiling')} | "
                     f"{_s(r, f'{form}_cold', 2)} | {_s(r, 'disk_read', 2)} | "
                     f"{_x(r, f'{form}_cold_vs_disk')} | {r['same_bytes']} |")
    return lines


def runs() -> list[tuple[str, dict[str, Any]]]:
    """(file name, result) per EP size, smallest first."""
    found = [(p.name, json.loads(p.read_text())) for p in FOLDER.glob("ep*.json")]
    return sorted(found, key=lambda run: int(run[0][2:-5]))


def _goals(found: list[tuple[str, dict[str, Any]]]) -> str:
    lines = []
    for _, run in found:
        for r in run["rows"]:
            for form in r.get("forms", []):
                warm, cold = r.get(f"{form}_warm_ready_vs_ceiling"), r.get(f"{form}_cold_vs_disk")
                if warm is None or cold is None:
                    continue
                lines.append(f"- EP {r['ep_size']} rank {r['rank']}, {_form_name(form)}: warm with the staging ready "
                             f"{warm:.2f}x of the page cache -> pinned copy (goal {WARM_GOAL}x: "
                             f"{'met' if warm >= WARM_GOAL else '**not met**'}), cold {cold:.2f}x of the disk's "
                             f"parallel read (goal {COLD_GOAL}x: {'met' if cold >= COLD_GOAL else '**not met**'}).")
    return "\n".join(lines)


def cold_shapes() -> str:
    """The reader shapes on a rank's cold store ranges (``cold-probe.log``): why a cold load runs more,
    smaller reads than a warm one."""
    path = FOLDER / "cold-probe.log"
    if not path.exists():
        return ""
    shapes = {}
    for line in path.read_text().splitlines():
        if m := re.match(r"^EP(\d+) (\d+)x(\d+)MB (\w+)\s+median ([\d.]+) ms", line):
            ep, threads, mb, how, ms = m.groups()
            shapes[f"{threads} x {mb} MB" + ("" if how == "plain" else f", {how}")] = float(ms)
    if not shapes:
        return ""
    cells = "; ".join(f"{k} {v:.0f} ms" for k, v in shapes.items())
    return (f"\nA cold load runs its own shape, more and smaller reads in flight (32 lanes, the ring's buffers cut "
            f"in halves), a warm one a lane per core (16): on these virtual disks more reads in flight read a "
            f"rank's store ranges faster, while a warm load is bound by memory bandwidth. The reader shapes on "
            f"EP {ep} rank 0's cold store ranges (`store-h100/cold-probe.log`, medians of 3): {cells}.\n")


def summary() -> list[str]:
    """The store row of the page's table of other figures (the largest EP size's run)."""
    run = runs()[-1][1]
    r = run["rows"][0]
    return ["the store, first call, one rank alone", f"warm {_s(r, 'store_warm_ready')} s "
            f"({_x(r, 'store_warm_ready_vs_ceiling')} of the limit), cold {_s(r, 'store_cold', 2)} s "
            f"({_x(r, 'store_cold_vs_disk')} of the disk)", "the page cache -> pinned copy (warm) and the disk's "
            "parallel read (cold), same rounds", f"1 x {short_gpu(run['host']['gpu'])}; rank {r['rank']} of EP {r['ep_size']}, "
            f"{r['bytes'] / 1e9:.2f} GB", "[store](#one-store-vs-the-per-rank-form)"]


def section() -> str:
    head = "## One store vs the per-rank form\n\n" + INTRO + "\n"
    found = runs()
    if not found:
        return head + "\nNot measured yet: run the first command above on a GPU machine.\n"
    tables = []
    for name, run in found:
        rows = sorted(run["rows"], key=lambda r: (r["ep_size"], r["rank"]))
        warm = [len(r[f"{f}_warm_ready"]["runs"]) for r in rows for f in r["forms"] if f"{f}_warm_ready" in r]
        cold = [len(r[f"{f}_cold"]["runs"]) for r in rows for f in r["forms"] if f"{f}_cold" in r]
        tables.append(f"`store-h100/{name}` ({run['host']['gpu']}, {run['host']['cpus']} CPUs; warm medians of "
                      f"{statistics.median(warm):.0f}, cold of {statistics.median(cold):.0f}):\n\n"
                      + "\n".join(HEADER + [line for r in rows for line in _rows(r)]))
    disk = {k: v for _, run in found for k, v in run.get("on_disk", {}).items()}
    sizes = "".join(f"\n- EP {ep}: the store holds {d['store_expert_bytes'] / 1e9:.2f} GB of experts, every rank "
                    f"of the per-rank form {d['per_rank_expert_bytes_all_ranks'] / 1e9:.2f} GB." for ep, d in disk.items())
    return (head + "\nEach EP size ran on another machine of the kind: compare within a table, not across.\n\n"
            + "\n\n".join(tables) + "\n\nAgainst the limits timed in the same rounds:\n\n" + _goals(found) + "\n"
            + cold_shapes() + f"\nOn-disk size:{sizes}\n")
