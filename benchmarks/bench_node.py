#!/usr/bin/env python3
"""A whole node's start-up: N rank processes, one per GPU, started together, each loading its
experts into vLLM 0.33's real ``DeepGemmMegaMoEExperts`` modules, for every load format a user
would pick, beside the node's disk and memory ceilings.

Each measurement is one fresh process per rank (``--child``): it imports, builds vLLM's real
expert modules on its GPU (``tests/engines/vllm_harness.py``: only the SM100 check and the process
groups patched), prepares what the load format's loader prepares when vLLM makes it, reports
ready, and waits; the parent drops the page cache (cold) or reads the files into it (warm), then
releases every rank at once; each times its first load. The forms:

  auto, auto_ep_filter, fastsafetensors, instanttensor, runai_streamer
            vLLM's own loader for that ``--load-format`` (``get_model_loader(...).load_weights``)
            over the source checkpoint; ``auto_ep_filter`` with the rank's expert ids from vLLM's
            ``compute_local_expert_ids`` (``--enable-ep-weight-filter``);
  megamoe_per_rank, megamoe_store
            ``megamoe_convert.engines.vllm.install`` from the per-rank form / the store, the
            staging started when the loader is made (``--load-format megamoe``);
  ipc_cache an engine restart: vLLM's ``IpcModelLoader`` mapping the experts of one weight-cache
            daemon per rank (``megamoe preload``'s, started once per shape; bench_daemon.py).

Ceilings, timed in the same rounds: ``disk_read`` (cold: the node's rank files read by one
process, 64 threads x 4 MB), and the node's page cache -> pinned -> device ceiling (warm: every
rank at once reading its files into pinned buffers, ``host_read``, and copying its bytes from
pinned memory to its GPU, ``h2d``; the ceiling is the slower). Shapes: one node holding every
rank (EP = N) and one node of a larger deployment (ranks 0..N-1 of EP 4N). Threads: torch and
OpenMP as vLLM 0.33 sets them for its workers' start-up (``startup_omp_num_threads``: the CPUs
shared among the node's workers). Measurements run in batches (``--batch``): a batch's processes
import and build together (vLLM's imports take tens of seconds), then its measurements run one at
a time, each on a quiet host, as a node's ranks start with nothing importing beside them. Rows
land in ``--save`` after each one.

    PYTHONPATH=/path/to/vllm-0.33 python3 benchmarks/bench_node.py --work /tmp/node --save r.json
    PYTHONPATH=/path/to/vllm-0.33 python3 benchmarks/bench_node.py --quick   # CPU smoke run

``--quick`` times nothing: its processes are forked from one that imported the engine once
(``node_zygote.py``), each still a process of its own per rank and form, released together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks", REPO / "tests" / "engines"):
    sys.path.insert(0, str(path))

from node_forms import CEILINGS, FORMS, Shape, child_main  # noqa: E402
from node_procs import Ranks, daemons, daemons_ready, drop_page_cache, stop, warm  # noqa: E402
from node_zygote import forking  # noqa: E402

from megamoe_convert.settings import layout_probe  # noqa: E402

# --------------------------------------------------------------------------------------
# One shape: its forms and ceilings, interleaved
# --------------------------------------------------------------------------------------

def node_row(kind: str, cache: str, reports: list[dict[str, Any]], shape: Shape, dropped: bool) -> dict[str, Any]:
    """The node's figures from its ranks' reports: wall time from the first release to the last end;
    a form moves the node's routed-expert bytes, a ceiling the rank files whole."""
    wall = max(r["end_unix"] for r in reports) - min(r["start_unix"] for r in reports)
    moved = shape.file_bytes() if kind in CEILINGS else shape.expert_bytes()
    row = {"form": kind, "cache": cache, "node_wall_s": round(wall, 4),
           "slowest_rank_s": round(max(r["seconds"] for r in reports), 4),
           "read_bytes": sum(r.get("read_bytes", 0) for r in reports), "expert_bytes": shape.expert_bytes(),
           "bytes_moved": moved, "gb_per_s": round(moved / wall / 1e9, 3), "ranks": reports}
    if cache == "cold":
        row["dropped"] = dropped
    return row


#: The forms a round times first, the ceilings right after them: a run cut short by its budget
#: still compares megamoe with vLLM's default loader at its limits.
FIRST = ("auto", "auto_ep_filter", "megamoe_per_rank", "megamoe_store", "ipc_cache")


def schedule(forms: list[str], caches: list[str], rnd: int, first: tuple[str, ...] = FIRST) -> list[tuple[str, str]]:
    """Every form's cold run then its warm one, the ceilings among them; odd rounds reversed
    (a host's drift touches every form alike)."""
    plan: list[tuple[str, str]] = []
    order = [f for f in forms if f in first] + ["ceilings"] + [f for f in forms if f not in first]
    for kind in order:
        for cache in caches:
            if kind == "ceilings":
                plan += ([("disk_read", "cold"), ("disk_read_ranks", "cold")] if cache == "cold"
                         else [("pipe", "warm"), ("host_read", "warm"), ("h2d", "warm")])
            elif kind.startswith("ipc_cache"):
                plan += [] if cache == "cold" else [(kind, "restart")]  # reads nothing from disk
            else:
                plan.append((kind, cache))
    return plan[::-1] if rnd % 2 else plan


def batch_size(shape: Shape, args: argparse.Namespace, with_daemons: bool) -> int:
    """How many measurements' processes start together: ``--batch``, or fewer where their rank
    processes (each holding about its rank's files, several to a GPU where ranks outnumber GPUs)
    would not fit a GPU's memory beside each other and the weight-cache daemons."""
    if not args.gpus:
        return args.batch
    import torch

    per_measurement = 1.25 * shape.file_bytes() / shape.n * -(-args.n // args.gpus)  # on one GPU
    room = 0.75 * torch.cuda.get_device_properties(0).total_memory - (per_measurement if with_daemons else 0)
    return max(1, min(args.batch, int(room // per_measurement)))


def measure(kind: str, cache: str, ranks: Ranks, shape: Shape, label: str,
            args: argparse.Namespace) -> dict[str, Any]:
    """One measurement: the page cache dropped (cold) or filled with the form's files (warm), then
    every rank released at once."""
    if ranks.error is not None:
        return {"form": kind, "cache": cache, "failed": ranks.error}
    dropped = drop_page_cache() if cache == "cold" else False
    if cache == "warm":
        warm(shape.files_of(kind), args.warm_reads)
    try:
        reports = ranks.go(args.form_timeout)
    except (RuntimeError, OSError, ValueError) as e:  # a rank that ended (a broken pipe) or wrote no report
        ranks.kill()  # no rank of it goes on loading beside the next measurement
        return {"form": kind, "cache": cache, "failed": str(e)[-1500:]}
    if "skipped" in reports[0]:
        return {"form": kind, "cache": cache, "skipped": reports[0]["skipped"]}
    row = node_row(kind, cache, reports, shape, dropped)
    print(f"{label} {cache:7s} {kind:17s} node {row['node_wall_s']:7.3f}s slowest "
          f"{row['slowest_rank_s']:7.3f}s read {row['read_bytes'] / 1e9:6.2f} GB", flush=True)
    return row


def late(step: tuple[str, str], rows: list[dict[str, Any]], args: argparse.Namespace) -> bool:
    """Whether the run's deadline passed before ``step`` (then a row says so)."""
    if time.time() <= args.deadline:
        return False
    rows.append({"form": step[0], "cache": step[1], "skipped": "the run's deadline passed"})
    return True


def spawn(steps: list[tuple[str, str]], shape: Shape, args: argparse.Namespace, rnd: int,
          into: list[tuple[str, str, Ranks]]) -> None:
    """Each step's rank processes, appended to ``into`` as they start (a caller that stops ``into``
    on an error stops every one that started)."""
    for kind, cache in steps:
        into.append((kind, cache, Ranks(kind, shape, args.work, args.gpus, args.n, args.threads, rnd == 0)))


def measure_shape(shape: Shape, args: argparse.Namespace, rnd: int, save) -> list[dict[str, Any]]:
    """The shape's plan in batches: a batch's processes import and build together, then its
    measurements run one at a time, each on a quiet host (the others wait, built, for their turn),
    as a node's ranks start with nothing else importing beside them."""
    rows: list[dict[str, Any]] = []
    forms = args.slice_forms if shape.ep_size != shape.n else args.forms
    restarts = [f for f in forms if f.startswith("ipc_cache")]
    held = daemons(shape, args.work, args.gpus, args.n, restarts) if restarts else []
    plan = schedule(forms, args.caches, rnd, engine_forms(args.engine)[1])
    size = batch_size(shape, args, bool(held))
    batch: list[tuple[str, str, Ranks]] = []
    try:
        at = 0
        while at < len(plan) and not late(plan[at], rows, args):
            spawn(plan[at:at + size], shape, args, rnd, batch)
            if at == 0 and held:  # the daemons load while the first batch imports
                try:
                    daemons_ready(held)
                except (RuntimeError, ValueError) as e:
                    rows += [{"form": f, "cache": "restart", "failed": f"daemon: {str(e)[-1500:]}"} for f in restarts]
                    plan = plan[:size] + [p for p in plan[size:] if p[0] not in restarts]
                    for kind, _, ranks in batch:
                        if kind in restarts:
                            ranks.kill()
                    batch[:] = [b for b in batch if b[0] not in restarts]
            for _, _, ranks in batch:
                ranks.settle()
            for kind, cache, ranks in batch:
                if late((kind, cache), rows, args):
                    return rows  # the batch's processes are stopped below
                rows.append({**measure(kind, cache, ranks, shape, f"{shape.name} r{rnd}", args), "batch": at // size})
                save(rows)
            stop_all(batch)
            at += size
    finally:
        stop_all(batch)
        stop(held)
    return rows


def stop_all(batch: list[tuple[str, str, Ranks]]) -> None:
    """Stop every process of ``batch`` (those that ended are reaped) and empty it."""
    for _, _, ranks in batch:
        ranks.kill()
    batch.clear()


# --------------------------------------------------------------------------------------
# Set-up, the run, the summary
# --------------------------------------------------------------------------------------

def convert(src: Path, out: Path, ep_size: int | None, ranks: str | None) -> None:
    """The store holds experts only; the per-rank form is whole (a weight-cache daemon serves it)."""
    if (out / "manifest.json").exists():
        return
    cmd = [sys.executable, "-m", "megamoe_convert.cli", "convert", str(src), str(out), "--no-fsync"]
    cmd += ["--ep-size", str(ep_size)] if ep_size else ["--experts-only"]
    cmd += ["--ranks", ranks] if ranks else []
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, env={**os.environ, "PYTHONPATH": path})


def setup(args: argparse.Namespace, layers: int) -> tuple[list[Shape], dict[str, Any]]:
    """The checkpoint of ``layers`` MoE layers, its store, and the per-rank form of each shape."""
    from common import bench_config, ensure_checkpoint

    base = args.work / f"{args.engine}-l{layers}" if args.engine != "vllm" else args.work / f"l{layers}"
    src = base / "src"
    if args.engine == "sglang":
        from node_forms_sglang import checkpoint_config

        config = checkpoint_config(args.preset, args.family, layers, args.experts)
    else:
        config = bench_config(args.preset, layers, args.experts, 0, 1024)
    synth_s = ensure_checkpoint(src, config)
    start = time.perf_counter()
    convert(src, base / "store", None, None)
    shapes = []
    for ep, name in ((args.n, "node"), (4 * args.n, "slice")):
        if name in args.shapes:
            per_rank = base / f"ep{ep}"
            convert(src, per_rank, ep, None if ep == args.n else f"0-{args.n - 1}")
            shapes.append(Shape(f"{name}-l{layers}", layers, ep, args.n, src, per_rank, base / "store",
                                args.sockets, args.engine))
    return shapes, {"layers": layers, "synth_s": synth_s, "convert_s": time.perf_counter() - start,
                    "source_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors")),
                    "store_bytes": sum(f.stat().st_size for f in (base / "store").rglob("*.safetensors"))}


def identical(results: dict[str, Any]) -> dict[str, bool]:
    """Per shape and rank, whether every form left the same kernel bytes (round 0 fingerprints)."""
    prints: dict[str, set[str]] = {}
    for step in results["steps"]:
        for row in step["rows"]:
            for r in row.get("ranks", []):
                if "fingerprint" in r:
                    prints.setdefault(f"{step['shape']} rank {r['rank']}", set()).add(r["fingerprint"])
    return {key: len(v) == 1 for key, v in prints.items()}


def positive(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--fingerprint", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--daemon", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, default=Path("/tmp/megamoe-node"))
    p.add_argument("--n", type=int, default=0, help="rank processes (default: one per GPU)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                   help="whose real modules and loaders: vLLM 0.33 (DeepSeek-V4, MXFP4) or SGLang 0.5.23 "
                        "(Hopper's FP8 MegaMoE, --family)")
    p.add_argument("--family", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe",
                   help="SGLang's model family (its published dims: Qwen3-235B-A22B, DeepSeek-V3)")
    p.add_argument("--preset", default=None, help="the checkpoint's dims (default: flash; SGLang: the family's)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (default: the preset's)")
    p.add_argument("--layers", default="8,2", help="MoE layer counts, each its own checkpoint, in this order")
    p.add_argument("--rounds", default="2,1", help="rounds for each of --layers")
    p.add_argument("--shapes", default="node,slice", help="node: EP = N; slice: ranks 0..N-1 of EP 4N")
    p.add_argument("--forms", default=None, help="default: every form of the engine")
    p.add_argument("--slice-forms", default="", help="the forms timed in the slice shape (default: --forms)")
    p.add_argument("--caches", default="cold,warm")
    p.add_argument("--budget-s", type=float, default=0, help="start nothing new after this many seconds")
    p.add_argument("--batch", type=positive, default=3,
                   help="measurements whose processes import together, then run one at a time on a quiet "
                        "host (fewer where their ranks would not fit a GPU's memory together)")
    p.add_argument("--warm-reads", type=positive, default=2,
                   help="reads of a warm row's files just before it (node_procs.warm)")
    p.add_argument("--form-timeout", type=float, default=150, help="stop a measurement that runs longer (s)")
    p.add_argument("--save", type=Path)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny dims, 2 rank processes, warm, "
                                                       "each form's code once (QUICK_FORMS)")
    args = p.parse_args(argv)
    forms, _ = engine_forms(args.engine)
    if args.quick and args.engine == "sglang":
        args.preset, args.layers, args.rounds, args.n, args.caches = preset(args, True), "1", "1", 2, "warm"
        args.forms, args.shapes, args.batch = args.forms or QUICK_FORMS["sglang"][0], "node", 8
    elif args.quick:
        args.preset, args.experts, args.layers, args.rounds, args.n = "tiny", 8, "1", "1", 2
        args.caches, (args.forms, args.slice_forms) = "warm", QUICK_FORMS["vllm"]
    args.preset = args.preset or preset(args, False)
    args.experts = args.experts or __import__("node_forms_sglang").expert_count(args.preset)
    args.forms = args.forms or ",".join(forms)
    args.layers = [int(x) for x in args.layers.split(",")]
    args.rounds = [int(x) for x in args.rounds.split(",")] + [1] * len(args.layers)
    args.shapes, args.forms, args.caches = args.shapes.split(","), args.forms.split(","), args.caches.split(",")
    args.slice_forms = args.slice_forms.split(",") if args.slice_forms else args.forms
    unknown = (set(args.forms) | set(args.slice_forms)) - set(forms)
    if unknown:
        raise SystemExit(f"--forms: unknown {sorted(unknown)}; known for {args.engine}: {', '.join(forms)}")
    return args


#: engine -> the forms of ``--quick`` in the node shape, and in the slice shape. Every process imports the
#: engine (seconds of CPU each), so each form's code runs once: vLLM's two loader forms and megamoe's
#: two split between the shapes (each shape still compares a vLLM form with a megamoe one), the form
#: that needs a GPU says why without a process; SGLang's ``auto`` and ``megamoe_per_rank`` loads run
#: in the restarts' daemons (``node_forms_sglang.DAEMONS``), whose experts the restarts map.
QUICK_FORMS = {"vllm": ("auto,instanttensor,megamoe_per_rank,ipc_cache", "auto_ep_filter,megamoe_store"),
               "sglang": ("presharded_dump,presharded,ipc_cache,ipc_cache_megamoe,megamoe_store", "")}


def engine_forms(engine: str) -> tuple[list[str], tuple[str, ...]]:
    """The engine's forms, and those a round times first."""
    if engine == "sglang":
        import node_forms_sglang

        return list(node_forms_sglang.FORMS), node_forms_sglang.FIRST
    return list(FORMS), FIRST


def preset(args: argparse.Namespace, tiny: bool) -> str:
    from node_forms_sglang import FAMILIES

    return ("tiny" if tiny else "flash") if args.engine == "vllm" else FAMILIES[args.family][1 if tiny else 0]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        shape = Shape.from_json(args.shape)
        if shape.engine == "sglang":
            import node_forms_sglang as sg

            if args.daemon:
                sg.daemon_main(args.child, args.rank, shape, START)
            else:
                sg.child_main(args.child, args.rank, shape, args.fingerprint, START)
        else:
            child_main(args.child, args.rank, shape, args.fingerprint, START)
        return {}
    if not args.quick:
        return run(args)
    with forking(args.engine, args.work):  # a smoke run: its processes forked from one engine import
        return run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    args.gpus = torch.cuda.device_count()
    args.n = args.n or max(1, args.gpus)
    # vLLM 0.33's set_multiprocessing_worker_envs: startup_omp_num_threads(N), the CPUs shared out
    args.threads = max(1, len(os.sched_getaffinity(0)) // args.n)
    args.deadline = time.time() + args.budget_s if args.budget_s else float("inf")
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    args.sockets = tempfile.mkdtemp(prefix="wc", dir="/tmp")  # short: a Unix socket's path is bounded
    from common import node_machine

    results: dict[str, Any] = {"benchmark": "node", "engine": args.engine,
                               "machine": node_machine(args.n, args.threads), "setup": [],
                               "steps": [], "preset": args.preset,
                               "forms": args.forms, "ceilings": list(CEILINGS), "warm_reads": args.warm_reads,
                               "layout_probe": layout_probe()}  # MEGAMOE_LAYOUT_PROBE=0: a diagnostic run

    def save(_: Any = None) -> None:
        if args.save:
            args.save.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.save.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1) + "\n")
            tmp.replace(args.save)

    prepared = []
    for layers in args.layers:  # every checkpoint written before any timing: files of alike history
        shapes, info = setup(args, layers)
        results["setup"].append(info)
        prepared.append((shapes, args.rounds[args.layers.index(layers)]))
        print(json.dumps(info), flush=True)
    start = time.perf_counter()
    os.sync()  # the conversions' dirty pages on disk: a cold run can drop every page it will read
    results["sync_s"] = time.perf_counter() - start
    save()
    for rnd in range(max(rounds for _, rounds in prepared)):  # round 0 of every size before any round 1
        for shape in [s for shapes, rounds in prepared if rounds > rnd for s in shapes]:
            if time.time() < args.deadline:
                step = {"shape": shape.name, "layers": shape.layers, "ep_size": shape.ep_size, "ranks": args.n,
                        "round": rnd, "rows": []}
                results["steps"].append(step)
                step["rows"] = measure_shape(shape, args, rnd, lambda rows, s=step: (s.update(rows=rows), save()))
    results["identical"] = identical(results)
    print(f"identical kernel bytes across forms: {results['identical']}", flush=True)
    save()
    print(json.dumps({"benchmark": "node", "steps": len(results["steps"]), "identical": results["identical"]}))
    return results


if __name__ == "__main__":
    main()
