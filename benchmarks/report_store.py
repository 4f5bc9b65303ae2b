"""The store section of docs/benchmarks.md (from benchmarks/results/store-*/*.json, saved by
benchmarks/bench_store.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

INTRO = r"""`benchmarks/bench_store.py` times, for ranks of each `--ep-sizes` (Flash dims by default), the
first call in a fresh process filling the rank's preallocated device tensors from the store
(`serve.store.load_slots`) and from the per-rank form (`load_rank(..., into=)`), warm (median of
`--repeats` children after a warming one) and cold (`--cold`, page cache dropped before each
child), the forms and the ceilings interleaved round-robin (from `r4/run2-interleaved` on; earlier
runs timed each form's children in a block), beside the ceilings `host_read` (the rank's bytes from
the page cache into pinned buffers, the loader's threads and pieces; from `r6` on, its threads
started before the clock as the loader's are) and `h2d_pinned`, and cold beside `disk_read` (the
rank's ranges read cold by the fastest of the reader shapes: the loader's warm and, from `r6` on,
cold lanes' shapes and 64 threads x 4 MB); it checks
the two forms give the same bytes and reports the on-disk expert bytes of the store against the
per-rank form's for all ranks. The warm first call is timed three ways: the staging started
early (as the engines' loaders and model classes start it, before the model is built), ready
before the call ("ring pinned": before `r6`, the ring pinned while the rest of the staging's
preparation, its streams, events and reader threads, could still be running at the call; from
`r6` on, all of it done, as a real model's build of seconds leaves it), and not started. From
`r6` on the cold call also finds the staging ready (before, it waited 20-30 ms for the ring).
`--store-knobs` adds the store under other `MEGAMOE_*` settings and `--baseline-tree DIR` the store
from another checkout (the commit before a change, say), timed in the same rounds.

```bash
PYTHONPATH=. python3 benchmarks/bench_store.py --preset flash --layers 2 --ep-sizes 8,16 --cold \
    --save benchmarks/results/store-h100-r2/run2.json   # on a GPU machine (as root for --cold)
PYTHONPATH=. python3 benchmarks/bench_store.py --quick   # CPU smoke run (tests/test_store.py)
```"""


def _s(r: dict[str, Any], key: str, digits: int = 3) -> str:
    v = r.get(key)
    return f"{v['seconds']:.{digits}f}" if isinstance(v, dict) and "seconds" in v else "-"


def _x(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.2f}x" if key in r else "-"


FORM_NAMES = {"per_rank": "per-rank", "store": "store", "store_ring": "store, ring alone",
              "store_fixed": "store, full-size pieces", "store_baseline": "store, baseline tree",
              "store_lanes": "store, per-reader copies"}


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
        name = _form_name(form)
        waited = r.get(f"{form}_warm", {}).get("waited_for_ring_s")
        early = _s(r, f"{form}_warm") + (f" ({waited * 1e3:.0f} ms)" if waited is not None else "")
        unprepared = _s(r, f"{form}_warm_unprepared")
        early_ratio = _x(r, f"{form}_warm_vs_ceiling")
        if f"{form}_warm_ready" not in r:  # before the staging work nothing was started early
            early, unprepared, early_ratio = "-", _s(r, f"{form}_warm"), "-"
        lines.append(f"| {r['ep_size']} | {r['rank']} | {r['bytes'] / 1e9:.2f} | {name} | {early} | "
                     f"{_s(r, f'{form}_warm_ready')} | {unprepared} | {_s(r, 'host_read')} | "
                     f"{early_ratio} | {_x(r, f'{form}_warm_ready_vs_ceiling')} | "
                     f"{_s(r, f'{form}_cold', 2)} | {_s(r, 'disk_read', 2)} | "
                     f"{_x(r, f'{form}_cold_vs_disk')} | {r['same_bytes']} |")
    return lines


def _knobs(r: dict[str, Any]) -> str:
    """The store cold under other reader shapes (``--cold-knobs``), beside the default."""
    knobs = r.get("store_cold_knobs")
    if not knobs or "disk_read" not in r:
        return ""
    disk = r["disk_read"]["seconds"]
    cells = [f"default {_s(r, 'store_cold', 2)} s ({_x(r, 'store_cold_vs_disk')})"]
    cells += [f"`{k}` {v['seconds']:.2f} s ({disk / v['seconds']:.2f}x)" for k, v in knobs.items() if "seconds" in v]
    return f"- EP {r['ep_size']} rank {r['rank']}, store cold vs disk read: " + "; ".join(cells)


HEADER = ["| EP | rank | rank GB | form | warm, ring started early (s) (of it waiting for the ring) | warm, ring pinned "
          "(s) | warm, nothing started (s) | page cache -> pinned (s) | "
          "early vs ceiling | ring pinned vs ceiling | cold (s) | disk read (s) | cold vs disk | same bytes |",
          "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]


def section() -> str:
    files = sorted(RESULTS.glob("store-*/*.json"))
    head = "## One store vs the per-rank form\n\n" + INTRO + "\n"
    if not files:
        return head + "\nNot measured yet: run the first command above on a GPU machine.\n"
    tables = []
    for f in files:
        rows = sorted(json.loads(f.read_text())["rows"], key=lambda r: (r["ep_size"], r["rank"]))
        lines = [line for r in rows for line in _rows(r)]
        knobs = "\n".join(filter(None, map(_knobs, rows)))
        tables.append(f"`{f.parent.name}/{f.name}`:\n\n" + "\n".join(HEADER + lines) + (f"\n\n{knobs}" if knobs else ""))
    disk = {k: v for f in files for k, v in json.loads(f.read_text()).get("on_disk", {}).items()}
    sizes = "".join(f"\n- EP {ep}: the store holds {d['store_expert_bytes'] / 1e9:.2f} GB of experts, every rank "
                    f"of the per-rank form {d['per_rank_expert_bytes_all_ranks'] / 1e9:.2f} GB." for ep, d in disk.items())
    return head + """
Measured on H100s (Flash dims, 2 MoE layers, rank 0, first call in a fresh process; warm:
median of 3, cold: page cache dropped, 2 runs; `r4/run2-interleaved`: 6 and 3; `r4/run3` and `r5`: 4 and 2;
`r6`: 5-6 and 4). Each run is on another machine of
the kind: ceilings and the disk differ between runs by up to 20%, so compare within a run.

- `store-h100/`: the loader before the staging work (the read ring pinned through `cudaHostAlloc`
  inside the first call, not started early).
- `store-h100-r2/`: `serve/staging.py` (huge-page memory registered by 8 threads, started when the
  engine's loader or model class is made); `run3` adds the ring's events and side stream made once
  and the reader threads started early.
- `store-h100-r3/`: readers take pieces from one queue of the load's ranges in file order as they
  come free, copies are issued in the order reads complete, and a failed read drains the reads in
  flight before it is raised. `run1-copier` and `run2-shrinking` are two ideas measured and
  rejected (below); `run3` is the code as it stands.
- `store-h100-r4/`: per-reader copies ("lanes", `lanes.patch`), measured and rejected (below): every
  form of `run0-lanes-chunks` and `run1-lanes` runs that variant (their plain forms with 96 x 4 MB
  and 48 x 8 MB chunks; `run0`'s ceilings varied 2x between rounds, so compare its forms, not its
  ratios); `run2-interleaved` times it against
  the code as it stands in one run, the two interleaved round-robin (6 warm and 3 cold repetitions,
  the ceilings in the same rounds), as `bench_store.py` now interleaves its forms and times a
  `--baseline-tree` beside the working tree. `run3` is `bench_store.py` so interleaved (4 warm and 2
  cold repetitions) on the code before `r5`.
- `store-h100-r5/`: per-reader copies again, now issued through the CUDA runtime's entry points
  without the GIL (`serve/device_copy.py`), 16 lanes x 2 x 16 MB: the code as it stands. Each run
  times it beside the code before (`--baseline-tree`, 8c731cd: the "store, baseline tree" rows):
  `run2-ep8` and `run2-ep16` on one machine, `run3-ep16` on another, `run4-ep16-cold` a cold run
  (3 cold repetitions, with `--cold-knobs`; its warm rows are single runs, not medians);
  `run5-ep8-willneed` and `run5-ep16-willneed` (two more machines, 4 warm and 3 cold repetitions)
  time `MEGAMOE_WILLNEED=1` beside the default.
  `first-call.log` times lane shapes' first calls in fresh processes against the ring
  (`first-call-probe.py.txt`), `llc-probe.log` the same
  copies in one process on a warm 1 GB file (`llc-probe.py.txt`), `run1-stagger-ep8.log` readers
  starting their first pieces staggered (no gain: 0.040 against 0.039 s, not kept).
- `store-h100-r6/`: the code as it stands. The lanes bind their device once per thread, not per
  load; a load whose first or last page is not in the page cache (a read that may not wait,
  `RWF_NOWAIT`, misses) runs the cold shape, 32 lanes on the ring's buffers cut in halves (same
  memory), a warm one the 16 lanes of `r5`; the rows' `shapes` say which ran. The benchmark's
  "ring pinned" case waits for the whole staging, cold calls find it ready, the ceiling's threads
  start before its clock. `run1-ep16` (before the ready wait and the cold shape) and `run2-ep16`
  (the ready wait, not the cold shape) on two machines; `run3-ep16`, `run4-ep8` and `run5-ep16` on
  a third, the code as it stands (`cuda-tests.log`: its CUDA tests, 9 passed), `run6-ep8` on a
  fourth. `cold-probe.log`
  (`cold-probe.py.txt`) the reader shapes on cold store ranges; `tail-probe.log`
  (`tail-probe.py.txt`) pieces shrinking over a load's tail, again rejected.

""" + "\n\n".join(tables) + f"""

- **Where it stands (`r6`, the code as it stands): cold met in every run, warm in all but one
  noisy machine's run.** With the staging ready, warm against the page cache -> pinned ceiling
  timed in the same rounds: 0.93x and 0.86x (EP 8, `run4`, `run6`), 1.10x and 0.55x (EP 16,
  `run5`, `run3`); cold against the disk's best parallel read of the same ranges: 0.93x and 1.03x
  (EP 8), 1.02x and 0.96x (EP 16). The miss is that machine's noise, not the store's: in `run3` the store's warm runs
  took 19-50 ms and the per-rank form's 21-54 ms with the same staging, the ceiling's 20-53 ms;
  `run2` (the warm path as it stands, another machine) 0.84x. Goals: warm 0.8x, cold 0.9x.
- **Cold: a cold load's own shape.** On the virtual disks of these hosts more, smaller reads in
  flight read a rank's store ranges faster (`cold-probe.log`, EP 16, medians of 3: 16 x 16 MB 414
  ms, 32 x 8 MB 357 ms, 64 x 4 MB 368 ms; advice to read each piece ahead, `WILLNEED` or only on
  a miss, 403-407 ms), while a warm load, bound by memory bandwidth and the GIL, is fastest with a
  lane per core. With the cold shape the store read at 0.93-1.02x of the disk's best shape (itself
  among the candidates) in `run3`-`run6`, against 0.83x and 0.85x with the warm shape (`run1`,
  `run2`).
- **The "ring pinned" case paid part of the staging's preparation** until `r6`: the benchmark
  waited for the pinned ring, but the lanes' streams and events, the reader threads and the CUDA
  runtime's lookup were still being made in the background, and the call waited for them: in
  `run1-ep16` the store's fast runs took 23.5-24.5 ms against 14.3-14.6 ms for the ceiling; waiting
  for the whole preparation, as a model build of seconds does, 19-21 ms (`run2`, `run5`).
- **Same bytes, same speed warm.** The store fills a rank like the per-rank form (one range per
  tensor through the same ring): 0.041 vs 0.046 s (EP 8) and 0.027 vs 0.027 s (EP 16) with the ring
  pinned (`r3/run3`).
- **Warm: 9-13x faster than the first loader; with the ring pinned, the goal met in three of five
  `r5` runs (`run4`'s single warm runs aside), the misses at 0.78-0.80x.** The first call went
  from 0.36 s to 0.037-0.040 s (EP 8) and from 0.32 s to 0.024-0.029 s (EP 16). Against the page cache -> pinned ceiling timed in the
  same rounds, with the ring pinned: 0.88x and 0.78x (EP 8, `run2`, `run5`), 1.25x, 0.89x and 0.80x
  (EP 16, `run2`, `run3`, `run5`; the ceiling's own runs spread 0.022-0.053 s in `run2`), against
  0.83-0.84x for the code before where it ran in the same rounds and 0.61-0.83x across `r3` and
  `r4`. The goal is 0.8x. With the ring started as the loaders start it, 0.52-0.65x (the code
  before: 0.56-0.67x): this benchmark's "model" is a few allocations, so the call still waits for
  the pinning (a real model's build takes seconds).
- **The ceiling is the host's memory bandwidth** (`r4/membw.log`). Sixteen threads read 1 GB from the
  page cache into pinned buffers in 0.029-0.031 s: 69 GB/s of memory traffic (each byte read and
  written), what a 16-thread `memcpy` reaches on that host (66-79 GB/s). A device copy running at
  full rate beside them slows those reads 1.2x. The ring moves every byte through host memory twice
  (a CPU copy from the page cache, then the copy engine's read), so it cannot match a ceiling that
  moves it once; that explains part of the gap, not all of it. Timed part by part in fresh
  processes (`r4/breakdown.log`, EP 8, ring pinned): the call 0.035 s against a ceiling of 0.026 s
  (0.75x), of it 4 ms opening the store and planning the reads and 0.031 s moving the bytes (0.84x).
- **Per-reader copies, measured and rejected** (`r4/`). Each reader thread owned its ring buffers and
  a CUDA stream and issued each 8 MB chunk's device copy itself, right after reading it: no main
  loop serializing the copies, and copies a chunk behind the reads, not a piece. Side by side with
  the code as it stands (`run2-interleaved`): warm with the ring pinned the same (EP 8: 0.039 vs
  0.040 s; EP 16: 0.030 vs 0.028 s); with the ring started early slower (0.063 vs 0.055 s; 0.055 vs
  0.039 s: twice the registrations and 16 streams to make); cold 0.94x / 1.04x of the disk against
  0.89x / 0.88x, within cold's spread between runs. Smaller chunks were slower still
  (`probe-lanes-shapes.log`: 4 MB chunks 0.77-0.81x of 8 MB's speed; `run0`: 2 MB chunks 2-5x
  slower): more Python calls per byte. Those copies went through `torch`, which holds the GIL while
  the CUDA runtime takes its locks.
- **Per-reader copies without the GIL: kept** (`r5/`). Issued through the runtime's own entry points
  (`ctypes` releases the GIL for the call), the same lanes move a warm 1 GB file to the device at
  0.97-1.02x of the page cache -> pinned read alone, the ring 0.83x (`llc-probe.log`, one process).
  In fresh processes' first calls (`first-call.log`, medians of 4, ring pinned) 16 lanes x 2 x 16 MB
  took 30.5 ms (EP 8) and 21.1 ms (EP 16) against 35.9 and 23.6 ms for the ring; 3 x 8 MB buffers
  per lane 36.6 and 27.0 ms, 2 x 8 MB 33.8 and 34.6 ms (twice the pieces), and the 3 x 8 MB lanes
  issuing copies through `torch` 43.8 and 28.0 ms.
- **Two ways past the ring, measured and rejected** (`r3/pagecache-dma-probe.log`):
  - *Device copies straight from the page cache.* Mapping a file read-only and registering its
    pages (`cudaHostRegisterReadOnly`) lets the copy engine read the page cache with no CPU copy:
    correct on every run, and in a bare probe the ring and such a copier together beat the ceiling
    (0.023-0.027 s against 0.024-0.033 s). Inside the loader, with 16 readers busy, a 64 MB
    registration took 2.3-5 ms and now and then 12-42 ms (the driver serializes them): 0.030-0.063 s
    against 0.032-0.035 s for the ring alone, and `run1-copier` shows it slower in every warm case.
  - *Pieces that shrink towards the end of a load* (to shorten the tail of copies after the last
    read): 0.056 s against 0.042 s with full-size pieces (`run2-shrinking`): more pieces cost more
    than the tail.
- **Cold: near the disk.** Against the disk's parallel read of the same ranges in the same run
  (`disk_read`), with the lanes (`r5`): 0.94x and 0.94x (EP 8, `run2`, `run5`), 0.86x, 0.85x, 0.93x
  and 0.98x (EP 16, `run2`, `run3`, `run4`, `run5`); the code before in the same rounds 0.82x, 0.82x
  and 0.85x. `MEGAMOE_WILLNEED=1` beside the default: 1.05x against 0.93x (`run4`), 0.93x against
  0.94x and 0.88x against 0.98x (`run5`): no better, so it stays off.
  Before the lanes the store 0.88x (EP 8) and 0.84x (EP 16) in `r3/run3`, 0.89x and 0.88x in
  `r4/run2-interleaved`, 0.87x and 0.81x in `r4/run3`, 1.00x and 1.04x with the same
  read order in `r3/run1-copier` (its ring-alone rows), 0.90x in `r3/run2-shrinking`; before the
  file-ordered queue, 0.81x and 0.70x (`r2/run3`). The per-rank form: 0.80-1.13x across runs. The
  goal is 0.9x: with the lanes met in both runs at EP 8 and two of four at EP 16 (misses 0.85-0.86x);
  before them in two of five runs at EP 8 and one of four at EP 16, the misses 0.81-0.89x.
  Cold children vary by about 15% run to run: in `run1-copier` the store with the copier (idle when
  cold: its blocks are not resident) read at 0.71x / 0.79x against 0.99x / 1.04x for the ring
  alone, but alternating the two on one file gave 0.43-0.57 s either way; deeper read queues and
  `MEGAMOE_WILLNEED=1` gave 0.83-0.88x in the same run (its knob lines above).

On-disk size:{sizes}
"""
