#!/usr/bin/env python3
"""One store vs the per-rank form: a rank's experts into preallocated device tensors, side by side.

For a checkpoint (real expert dims from a preset, fewer layers, ``--experts-only``) this converts
a store (no ``--ep-size``) and, for each ``--ep-sizes``, the per-rank form of the benchmarked
ranks; then, for each (EP size, rank, form), times the **first call in a fresh process**: a child
process imports the package, starts pinning the read ring in the background as the engines' loaders
do when vLLM / SGLang make them (``--staging early``; ``none``: the call pays the pinning itself,
as a bare ``install()`` with no loader does), allocates the rank's destination tensors on the device
(as an engine does when it builds the model), and times filling them (``load_rank(..., into=)`` for
the per-rank form, ``serve.store.load_slots(..., into=)`` for the store: the same staging, the
pinned ring), any wait for the ring included. The forms and the ceilings are interleaved: each
repetition runs each of them once, so a host's drift during the run touches them alike.
``--store-knobs`` and ``--baseline-tree`` add forms: the store under other ``MEGAMOE_*`` settings,
and the store from another checkout (a code change against the commit before it).

  warm   the files in the page cache (a throwaway child reads them first), ``--repeats`` children,
         median, with the staging started early (the rows' ``waited_for_ring_s``), all of its
         preparation over before the call (``warm_ready``: ring pinned, the lanes' streams and
         events made, reader threads started, as a model build of seconds leaves it) and not
         started (``warm_unprepared``); the ceiling beside it is ``host_read``: the rank's bytes
         read from the page cache into pinned buffers by as many threads as the loader has,
         started before the clock, in the loader's own pieces (its work queue), no device copy, and
         ``h2d_pinned``: one pinned buffer of the rank's bytes
         copied to the device;
  cold   the page cache dropped before each child (needs root; otherwise the rows say so), the
         staging prepared before the call as in ``warm_ready``; the limit beside it is
         ``disk_read``: the rank's ranges read cold in the loader's warm or cold lanes' shape or
         by 64 threads x 4 MB, whichever is fastest (the page cache dropped before each);
         ``--cold-knobs`` times the store cold under other reader shapes (``MEGAMOE_*`` settings).

Correctness is checked once per (EP size, rank): the store's tensors equal the per-rank form's.
On-disk size: the store's expert bytes against the per-rank form's for every rank of each EP size
(from the manifests' exact sizes). The last line printed is JSON (``--save FILE`` writes it too).
One child's measurement is ``store_child.py``'s; this script is the parent and, run with ``--child``, each child.

    PYTHONPATH=. python3 benchmarks/bench_store.py --preset flash --layers 2 --ep-sizes 8,16   # GPU
    PYTHONPATH=. python3 benchmarks/bench_store.py --quick        # CPU smoke test (tests/e2e/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from common import drop_page_cache  # noqa: E402  (the benchmarks' one way to go cold)
from store_child import child  # noqa: E402  (one measurement, in the fresh process this script is run as)


@dataclass(frozen=True)
class Form:
    """One way of filling the rank timed side by side: a child kind, under ``env``, with the
    package of ``tree`` (another checkout: a code change against its baseline) or this one."""

    kind: str
    env: dict[str, str] = field(default_factory=dict)
    tree: Path = REPO


#: The forms timed. ``--store-knobs`` adds the store under other ``MEGAMOE_*`` settings and
#: ``--baseline-tree`` the store from another checkout, timed side by side.
FORMS = {"per_rank": Form("per_rank"), "store": Form("store")}


#: The loader's settings a form can change (``megamoe_convert.serve.staging``'s docstring).
SETTINGS = ("MEGAMOE_READ_THREADS", "MEGAMOE_FAST_PIN", "MEGAMOE_CUDART")


def knob_env(knobs: str) -> dict[str, str]:
    """``'MEGAMOE_A=1,MEGAMOE_B=2'`` as an environment."""
    pairs = [kv for kv in knobs.split(",") if kv]
    for kv in pairs:
        if not kv.startswith("MEGAMOE_") or "=" not in kv:
            raise SystemExit(f"knobs {knobs!r}: expected MEGAMOE_NAME=VALUE settings separated by commas, got {kv!r}")
        if kv.split("=", 1)[0] not in SETTINGS:
            raise SystemExit(f"knobs {knobs!r}: {kv.split('=', 1)[0]} is no loader setting "
                             f"(one of {', '.join(SETTINGS)})")
    return dict(kv.split("=", 1) for kv in pairs)


def run_child(kind: str, args: argparse.Namespace, store_dir: Path, per_rank: Path, ep: int, rank: int,
              cold: bool = False, staging: str = "early", env: dict[str, str] | None = None,
              tree: Path = REPO) -> dict[str, Any]:
    if cold and not drop_page_cache():
        return {"skipped": "cannot drop the page cache (needs root)"}
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_store.py"), "--child", kind, "--store", str(store_dir),
           "--per-rank", str(per_rank), "--ep", str(ep), "--rank", str(rank), "--device", args.device,
           "--staging", staging]
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))  # the wheels' folder too
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {}), "PYTHONPATH": path})
    if proc.returncode:
        raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if any("skipped" in r for r in rows):
        return rows[0]
    seconds = statistics.median(r["seconds"] for r in rows)
    result = {"seconds": round(seconds, 4), "gb_per_s": float(f"{rows[0]['bytes'] / seconds / 1e9:.4g}"),  # never 0
              "runs": [round(r["seconds"], 4) for r in rows]}
    for key in ("pin_s", "waited_for_ring_s"):
        if all(key in r for r in rows):
            result[key] = round(statistics.median(r[key] for r in rows), 4)
    if all("lanes" in r for r in rows):  # each run's lanes x parts: a warm load must have taken the warm shape
        result["shapes"] = sorted({f"{r['lanes']}x{r['parts']}" for r in rows})
    fastest = min(rows, key=lambda r: r["seconds"])
    result.update({key: fastest[key] for key in ("threads", "piece_mb") if key in fastest})  # disk_read's shape
    return result


# --------------------------------------------------------------------------------------
# The parent: checkpoint, conversions, measurements
# --------------------------------------------------------------------------------------

def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, Path, dict[int, Path]]:
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert
    from megamoe_convert.synth import synthesize
    from megamoe_convert.synth.presets import load_preset

    config = dict(load_preset(args.preset))
    config.update(num_hidden_layers=args.layers, num_nextn_predict_layers=0, vocab_size=1024,
                  num_hash_layers=min(config.get("num_hash_layers", 0), args.layers),
                  **({"n_routed_experts": args.experts} if args.experts else {}))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "ckpt"
    marker = work / "ckpt.config.json"
    if not (marker.exists() and json.loads(marker.read_text()) == config and (src / "config.json").exists()):
        import shutil

        shutil.rmtree(src, ignore_errors=True)
        (work / "preset.json").write_text(json.dumps(config))
        synthesize(src, str(work / "preset.json"), seed=1)
        marker.write_text(json.dumps(config))
    store_dir = work / "store"
    convert(src, store_dir, ConvertOptions(ep_size=None, experts_only=True, fsync=False))
    per_rank = {}
    for ep in args.ep_sizes:
        per_rank[ep] = work / f"ep{ep}"
        convert(src, per_rank[ep], ConvertOptions(ep_size=ep, experts_only=True, fsync=False,
                                                  ranks=",".join(map(str, ranks_of(args, ep)))))
    return src, store_dir, per_rank


def ranks_of(args: argparse.Namespace, ep: int) -> list[int]:
    return sorted({r % ep for r in args.ranks} | ({ep - 1} if args.last_rank else set()))


def on_disk(store_dir: Path, ep: int) -> dict[str, int]:
    """The store's expert bytes, and the per-rank form's for every rank of ``ep`` (exact sizes)."""
    from megamoe_convert.layout.placement import Placement
    from megamoe_convert.output.manifest import read_manifest
    from megamoe_convert.output.shards import rank_shard_size

    manifest = read_manifest(store_dir)
    store_bytes = sum(manifest.file(manifest.expert_file(layer)).size for layer in manifest.layers)
    per_rank = sum(rank_shard_size(layer, r, Placement.default(manifest.dims.experts_of(layer), ep), manifest.dims)
                   for layer in manifest.layers for r in range(ep))
    return {"store_expert_bytes": store_bytes, "per_rank_expert_bytes_all_ranks": per_rank}


WARM_CASES = {"warm": "early", "warm_ready": "ready", "warm_unprepared": "none"}


def warm_cases(forms: dict[str, Form], quick: bool) -> dict[str, list[str]]:
    """Each form's warm cases: every one, or with ``--quick`` one each, in turn (each case and each form
    still runs once: a child is seconds of imports on a CPU)."""
    cases = list(WARM_CASES)
    return {name: [cases[i % len(cases)]] if quick else cases for i, name in enumerate(forms)}


def measure(args: argparse.Namespace, forms: dict[str, Form], cold_knobs: dict[str, Form], store_dir: Path,
            pr: Path, ep: int, rank: int) -> dict[str, Any]:
    """One (EP size, rank): every form's cases and the ceilings, interleaved (each repetition runs
    each of them once, so the host's drift during the run touches every form alike), as medians;
    with ``--cold``, the store under each of ``cold_knobs``' settings cold too."""
    def child(kind: str, form: Form | None = None, **how: Any) -> dict[str, Any]:
        form = form or Form(kind)
        return run_child(kind, args, store_dir, pr, ep, rank, env=form.env, tree=form.tree, **how)

    check = child("check")
    row: dict[str, Any] = {"ep_size": ep, "rank": rank, "bytes": check["bytes"], "same_bytes": check["same"],
                           "forms": list(forms)}
    samples: dict[str, list[dict[str, Any]]] = {}
    cases = warm_cases(forms, args.quick)
    if not args.quick:
        for form in forms.values():
            child(form.kind, form)  # the page cache warm, each tree's imports compiled
    for _ in range(args.repeats):
        for name, form in forms.items():
            for case in cases[name]:
                samples.setdefault(f"{name}_{case}", []).append(child(form.kind, form, staging=WARM_CASES[case]))
        for ceiling in ("host_read", "h2d_pinned"):
            samples.setdefault(ceiling, []).append(child(ceiling))
    if args.cold:
        for _ in range(args.cold_repeats):
            for name, form in forms.items():
                # The staging prepared before the call, as a real model's build (seconds) leaves it
                samples.setdefault(f"{name}_cold", []).append(child(form.kind, form, cold=True, staging="ready"))
            samples.setdefault("disk_read", []).append(child("disk_read", cold=True))
            for knobs, form in cold_knobs.items():
                samples.setdefault(f"knobs {knobs}", []).append(child(form.kind, form, cold=True, staging="ready"))
    medians = {key: median_of(runs) for key, runs in samples.items()}
    row.update({key: value for key, value in medians.items() if not key.startswith("knobs ")})
    if args.cold and cold_knobs:
        row["store_cold_knobs"] = {knobs: medians[f"knobs {knobs}"] for knobs in cold_knobs}
    limit = min(row["host_read"]["gb_per_s"], row["h2d_pinned"]["gb_per_s"])
    for name in forms:
        for case in cases[name]:
            row[f"{name}_{case}_vs_ceiling"] = round(row[f"{name}_{case}"]["gb_per_s"] / limit, 3)
        if args.cold and "gb_per_s" in row[f"{name}_cold"] and "gb_per_s" in row["disk_read"]:
            row[f"{name}_cold_vs_disk"] = round(row[f"{name}_cold"]["gb_per_s"] / row["disk_read"]["gb_per_s"], 3)
    return row


def describe_tree(tree: Path) -> dict[str, str]:
    """A baseline checkout's path and commit ("unknown" unless it is a git checkout's top)."""
    def git(*argv: str) -> str:
        proc = subprocess.run(["git", "-C", str(tree), *argv], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    top = git("rev-parse", "--show-toplevel")
    commit = git("log", "-1", "--format=%h %s")[:120] if top and Path(top).resolve() == tree.resolve() else ""
    return {"path": str(tree), "commit": commit or "unknown"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    # The forms and the --cold-knobs, checked before minutes of conversion.
    cold_knobs = {knobs: Form("store", knob_env(knobs)) for knobs in args.cold_knobs}
    forms = dict(FORMS)
    forms.update({f"store {knobs}": Form("store", knob_env(knobs)) for knobs in args.store_knobs})
    if args.baseline_tree:
        baseline = Path(args.baseline_tree).resolve()
        if not (baseline / "benchmarks" / "bench_store.py").is_file() or not (baseline / "megamoe_convert").is_dir():
            raise SystemExit(f"--baseline-tree {args.baseline_tree}: expected a megamoe-convert checkout "
                             "(benchmarks/bench_store.py and megamoe_convert/ in it)")
        forms["store_baseline"] = Form("store", tree=baseline)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    _, store_dir, per_rank = prepare(args, work)
    rows = []
    for ep in args.ep_sizes:
        for rank in ranks_of(args, ep):
            row = measure(args, forms, cold_knobs, store_dir, per_rank[ep], ep, rank)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    summary = {"benchmark": "bench_store", "device": args.device, "preset": args.preset, "layers": args.layers,
               "experts": args.experts or None, "rows": rows,
               "on_disk": {ep: on_disk(store_dir, ep) for ep in args.ep_sizes},
               "host": {"cpus": os.cpu_count()}}
    if args.baseline_tree:
        summary["baseline_tree"] = describe_tree(Path(args.baseline_tree))
    if args.device.startswith("cuda"):
        import torch

        summary["host"]["gpu"] = torch.cuda.get_device_name(0)
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=0, help="routed experts (0: the preset's)")
    p.add_argument("--ep-sizes", default="8,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--ranks", default="0", type=lambda s: [int(x) for x in s.split(",")],
                   help="ranks to time (mod each EP size); the last rank too unless --no-last-rank")
    p.add_argument("--no-last-rank", dest="last_rank", action="store_false")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="also cold runs (drops the page cache: root)")
    p.add_argument("--cold-repeats", type=int, default=2)
    p.add_argument("--cold-knobs", default=[], type=lambda s: [k for k in s.split(";") if k],
                   help="with --cold: also time the store cold under each of these settings, e.g. "
                        "'MEGAMOE_READ_THREADS=32;MEGAMOE_READ_THREADS=8'")
    p.add_argument("--store-knobs", default=[], type=lambda s: [k for k in s.split(";") if k],
                   help="also time the store (warm, and cold with --cold) under each of these settings, side by "
                        "side, e.g. 'MEGAMOE_READ_THREADS=32;MEGAMOE_FAST_PIN=0'")
    p.add_argument("--baseline-tree", default=None,
                   help="also time the store with the package of this checkout (e.g. a git worktree of the commit "
                        "before a change), side by side")
    p.add_argument("--workdir", default="/tmp/megamoe-bench-store")
    p.add_argument("--save", default=None)
    p.add_argument("--quick", action="store_true", help="CPU smoke test: the tiny preset, rank 1 of EP 2, one run, "
                                                       "one warm case per form (warm_cases)")
    # the child's own arguments
    p.add_argument("--child", default=None)
    p.add_argument("--store", default=None)
    p.add_argument("--per-rank", default=None)
    p.add_argument("--ep", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--staging", choices=("early", "ready", "none"), default="early",
                   help="early: prepare the staging (pin the read ring...) when the 'engine' starts, as the loaders "
                        "do; ready: and all of that is over before the call; none: the call pays it")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.layers, args.experts, args.device = "tiny", 1, 0, "cpu"
        args.ep_sizes, args.ranks, args.last_rank, args.repeats, args.cold = [2], [1], False, 1, False
    return args


if __name__ == "__main__":
    main()
