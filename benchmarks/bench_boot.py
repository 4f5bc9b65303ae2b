#!/usr/bin/env python3
"""A whole node's start: how many seconds sooner does every rank hold a loaded model, from the
interpreter's start, with ``--load-format megamoe`` than with vLLM 0.33's ``--load-format auto``?

Each measurement starts one fresh process per GPU, all at once (``boot_child.py``); each imports
vLLM, reads the config ``vllm serve`` makes (``--moe-backend deep_gemm_mega_moe
--enable-expert-parallel --enforce-eager``), makes vLLM's process groups (a world of one process,
its EP rank set), makes the load format's loader, builds vLLM 0.33's real ``DeepseekV4ForCausalLM``
on its GPU (attention, MoE blocks, embedding, head), loads every weight through the loader and runs
vLLM's ``process_weights_after_loading``; every phase is timed, and the weight phase split between
the routed experts and everything else. The node's time runs from the first process's spawn to the
last rank's end. What vLLM's start does after this on an SM100 GPU (the MegaMoE kernels' JIT and
symmetric buffers, KV-cache sizing, CUDA graphs of the MegaMoE kernel) does not run on Hopper and is
not timed.

Shapes: ``slice`` (one node of EP 4N: ranks 0..N-1; the source holds the experts those ranks read and
every non-expert tensor) at ``--slice-layers``, and ``node`` (EP N, every rank) at each of
``--node-layers`` (the per-layer slope). Rows land in ``--save`` after each one; ``--budget-s`` starts
nothing new after that many seconds.

``--engine sglang``: the same with SGLang 0.5.23 (``boot_child_sglang.py``): its real model class of the
preset's family (Qwen3-MoE's ``Qwen3MoeForCausalLM``, FP8 128x128 blocks) built and loaded by SGLang's
own ``get_model_loader(...).load_model``, ``--load-format auto`` against ``--load-format megamoe``
(the plugin loaded as SGLang loads plugins); the source is the preset synthesised whole (every expert
of every layer: SGLang's ``auto`` reads them all), converted with ``megamoe convert --engine sglang``.

    PYTHONPATH=/path/to/vllm-0.33 python3 benchmarks/bench_boot.py --work /tmp/boot --save r.json
    PYTHONPATH=/path/to/vllm-0.33 python3 benchmarks/bench_boot.py --smoke   # CPU, seconds
    PYTHONPATH=/path/to/sglang-0.5.23 python3 benchmarks/bench_boot.py --engine sglang --smoke
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks", REPO / "tests" / "engines"):
    sys.path.insert(0, str(path))

#: What a smoke run's checkpoint is: DeepSeek-V4's fields at small sizes (real attention classes).
SMOKE_CONFIG = {"hidden_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 2,
                "num_attention_heads": 8, "head_dim": 128, "q_lora_rank": 256, "o_lora_rank": 256, "o_groups": 2,
                "index_n_heads": 4, "index_head_dim": 64, "index_topk": 64, "vocab_size": 1024,
                "num_hash_layers": 1}
#: engine -> (its default preset, the smoke run's preset, the slice's default MoE layers)
PRESETS = {"vllm": ("flash", "flash", 44), "sglang": ("qwen3-moe", "qwen3-moe-tiny", 24)}


# --------------------------------------------------------------------------------------
# Set-up: the source, written from the model vLLM builds, and its conversion
# --------------------------------------------------------------------------------------

def shape_config(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """The preset's config cut to ``layers`` MoE layers, no MTP (the draft model is not built), the
    non-expert weights in BF16 (no ``quantization_config``)."""
    from common import bench_config

    config = bench_config(args.preset, layers, args.experts, 0, 129280)
    config.update(SMOKE_CONFIG if args.smoke else {})
    config.update(num_hidden_layers=layers, num_hash_layers=min(config.get("num_hash_layers", 0), layers))
    config.pop("quantization_config", None)
    return config


def child(role: str, model: Path, rank: int, ep_size: int, ranks: int, gpu: int | None, threads: int,
          log: Path, port: int = 0, engine: str = "vllm") -> subprocess.Popen:
    from node_procs import child_env

    argv = {"role": role, "model": str(model), "rank": rank, "ep_size": ep_size, "ranks": ranks, "port": port,
            "engine": engine, "spawned": time.time()}
    gpus = {"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {}
    env = child_env({"OMP_NUM_THREADS": str(threads), **gpus})
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, __file__, "--child", json.dumps(argv)], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)


def report_of(proc: subprocess.Popen, log: Path, timeout: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"no report within {timeout:.0f} s (stopped)") from None
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"exit {proc.returncode}:\n{log.read_text()[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def setup(name: str, layers: int, ep_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """``work/NAME/src`` (config.json, the non-expert tensors, each layer's experts that ranks
    0..N-1 read) and ``work/NAME/ep{EP}`` (``megamoe convert --ep-size EP --ranks 0-(N-1)``)."""
    from common import repo_env

    base = args.work / name
    src, out = base / "src", base / f"ep{ep_size}"
    if args.engine == "sglang":
        return setup_sglang(name, layers, ep_size, args)
    config = shape_config(args, layers)
    marker = base / "setup.json"
    if marker.exists() and json.loads(marker.read_text())["config"] == config:
        return {**json.loads(marker.read_text()), "reused": True}
    shutil.rmtree(base, ignore_errors=True)
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(config, indent=1))
    t0 = time.perf_counter()
    log = args.work / "logs" / f"{name}-source.err"
    made = report_of(child("source", src, 0, ep_size, args.n, None, 1, log), log, 1800)
    synth_s, t0 = time.perf_counter() - t0, time.perf_counter()
    cmd = [sys.executable, "-m", "megamoe_convert.cli", "convert", str(src), str(out), "--no-fsync",
           "--ep-size", str(ep_size), "--ranks", f"0-{args.n - 1}"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, env=repo_env())
    info = {"name": name, "layers": layers, "ep_size": ep_size, "config": config, **made, "synth_s": synth_s,
            "convert_s": time.perf_counter() - t0, "source_bytes": _bytes(src), "converted_bytes": _bytes(out)}
    marker.write_text(json.dumps(info))
    return info


def setup_sglang(name: str, layers: int, ep_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """``work/NAME/src`` (the preset synthesised at ``layers`` MoE layers, every expert, completed with
    the non-expert tensors SGLang's model loads that synth does not write: ``boot_child_sglang``'s
    ``source`` role) and ``work/NAME/ep{EP}`` (``megamoe convert --engine sglang --ep-size EP --ranks
    0-(N-1)``)."""
    from common import ensure_checkpoint, repo_env
    from node_forms_sglang import checkpoint_config

    from megamoe_convert.synth.presets import load_preset

    base = args.work / name
    src, out = base / "src", base / f"ep{ep_size}"
    config = checkpoint_config(args.preset, load_preset(args.preset)["model_type"], layers, args.experts)
    marker = base / "setup.json"
    if marker.exists() and json.loads(marker.read_text())["config"] == config:
        return {**json.loads(marker.read_text()), "reused": True}
    shutil.rmtree(base, ignore_errors=True)
    t0 = time.perf_counter()
    ensure_checkpoint(src, config)
    log = args.work / "logs" / f"{name}-source.err"
    made = report_of(child("source", src, 0, ep_size, args.n, None, 1, log, engine="sglang"), log, 1800)
    synth_s, t0 = time.perf_counter() - t0, time.perf_counter()
    cmd = [sys.executable, "-m", "megamoe_convert.cli", "convert", str(src), str(out), "--no-fsync", "--engine",
           "sglang", "--ep-size", str(ep_size), "--ranks", f"0-{args.n - 1}"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, env=repo_env())
    info = {"name": name, "layers": layers, "ep_size": ep_size, "config": config, **made, "synth_s": synth_s,
            "convert_s": time.perf_counter() - t0, "source_bytes": _bytes(src), "converted_bytes": _bytes(out),
            **_rest_of(src)}
    marker.write_text(json.dumps(info))
    return info


def _rest_of(src: Path) -> dict[str, int]:
    """The source's non-expert tensors and their bytes (off the safetensors headers)."""
    from megamoe_convert.source.safetensors_io import read_header

    tensors = [t for f in sorted(src.glob("*.safetensors")) for name, t in read_header(f).tensors.items()
               if ".mlp.experts." not in name]
    return {"rest_tensors": len(tensors), "rest_bytes": sum(t.nbytes for t in tensors)}


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*.safetensors"))


# --------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------

def measure(info: dict[str, Any], form: str, cache: str, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every rank process of the node started at once; the node's time from the first spawn to the
    last rank's end."""
    from common import drop_page_cache
    from node_procs import warm

    base = args.work / info["name"]
    model = base / ("src" if form == "auto" else f"ep{info['ep_size']}")
    row: dict[str, Any] = {"shape": info["name"], "layers": info["layers"], "ep_size": info["ep_size"], "form": form,
                           "cache": cache, "round": rnd}
    if cache == "cold":
        row["dropped"] = drop_page_cache()
    else:
        warm(sorted(model.rglob("*.safetensors")), 2)
    logs = [args.work / "logs" / f"{info['name']}-{form}-{cache}-r{rnd}-{rank}.err" for rank in range(args.n)]
    port = 29500 + 97 * (args.calls % 50)
    args.calls += 1
    procs = [child(form, model, rank, info["ep_size"], args.n, rank % args.gpus if args.gpus else None,
                   args.threads, log, port + rank, args.engine) for rank, log in enumerate(logs)]
    try:
        reports = [report_of(p, log, args.timeout) for p, log in zip(procs, logs, strict=True)]
    except RuntimeError as e:
        for p in procs:
            p.kill()
            p.wait()
        return {**row, "failed": str(e)[-2000:]}
    row.update(node_s=round(max(r["end_unix"] for r in reports) - min(r["spawned_unix"] for r in reports), 4),
               ranks=reports)
    print(f"{info['name']:10s} {cache:4s} {form:8s} node {row['node_s']:7.2f} s  weights "
          f"{max(r['phases']['weights'] for r in reports):6.2f} s (experts "
          f"{max(r['weights_experts_s'] for r in reports):6.2f}, the rest "
          f"{max(r['weights_rest_s'] for r in reports):6.2f})", flush=True)
    return row


def plan(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(shape name, MoE layers, EP size): the slice first, then the node at each layer count."""
    shapes = [(f"slice-l{args.slice_layers}", args.slice_layers, 4 * args.n)] if "slice" in args.shapes else []
    return shapes + [(f"node-l{n}", n, args.n) for n in args.node_layers if "node" in args.shapes]


def run(args: argparse.Namespace, results: dict[str, Any], save: Any) -> None:
    """Each shape set up, measured, and (``--clean``) removed before the next: the forms interleave,
    cold then warm, odd rounds reversed."""
    for name, layers, ep_size in plan(args):
        if time.time() > args.deadline:
            results["skipped"].append(name)
            continue
        info = setup(name, layers, ep_size, args)
        results["setup"].append(info)
        print(json.dumps({k: v for k, v in info.items() if k != "config"}), flush=True)
        os.sync()
        for rnd in range(args.rounds):
            caches = args.node_caches if name.startswith("node") else args.caches
            steps = [(form, cache) for cache in caches for form in args.forms]
            for form, cache in steps[::-1] if rnd % 2 else steps:
                if time.time() > args.deadline:
                    results["skipped"].append(f"{name} {form} {cache} r{rnd}")
                    continue
                results["rows"].append(measure(info, form, cache, rnd, args))
                save()
        if args.clean:
            shutil.rmtree(args.work / name, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, default=Path("/tmp/megamoe-boot"))
    p.add_argument("--save", type=Path)
    p.add_argument("--n", type=int, default=0, help="rank processes (default: one per GPU; more share the GPUs "
                                                   "in turn: a node of more GPUs, as its disk and page cache see it)")
    p.add_argument("--engine", choices=sorted(PRESETS), default="vllm",
                   help="vllm: vLLM 0.33's DeepSeek-V4; sglang: SGLang 0.5.23's Qwen3-MoE (FP8, Hopper's MegaMoE)")
    p.add_argument("--preset", help="the synth preset of its dims (default: the engine's)")
    p.add_argument("--experts", type=int, help="routed experts (default: vllm 256, sglang the preset's)")
    p.add_argument("--shapes", default="slice,node", help="slice: ranks 0..N-1 of EP 4N; node: EP N")
    p.add_argument("--slice-layers", type=int, help="the slice's MoE layers (default: vllm 44, sglang 24)")
    p.add_argument("--node-layers", default="1,2,4", help="the node shape's MoE layer counts (the slope)")
    p.add_argument("--forms", default="auto,megamoe")
    p.add_argument("--caches", default="cold,warm")
    p.add_argument("--node-caches", default="", help="the node shape's caches (default: --caches)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=0, help="start nothing new after this many seconds")
    p.add_argument("--timeout", type=float, default=300, help="stop a measurement's ranks after this long (s)")
    p.add_argument("--clean", action="store_true", help="remove each shape's files once measured (disk)")
    p.add_argument("--smoke", action="store_true", help="CPU, two ranks, a small model of DeepSeek-V4's "
                                                       "classes: seconds (tests/e2e/test_benchmarks.py)")
    args = p.parse_args(argv)
    preset, smoke_preset, slice_layers = PRESETS[args.engine]
    args.preset = args.preset or (smoke_preset if args.smoke else preset)
    args.slice_layers = args.slice_layers or slice_layers
    if args.smoke:
        args.n, args.slice_layers, args.node_layers, args.caches, args.node_caches = 1, 2, "1", "warm", ""
        args.experts = 8
    if args.experts is None:
        args.experts = 256 if args.engine == "vllm" else __import__("node_forms_sglang").expert_count(args.preset)
    args.node_layers = [int(x) for x in args.node_layers.split(",") if x]
    args.shapes, args.forms, args.caches = args.shapes.split(","), args.forms.split(","), args.caches.split(",")
    args.node_caches = args.node_caches.split(",") if args.node_caches else args.caches
    unknown = set(args.forms) - {"auto", "megamoe"}
    if unknown:
        p.error(f"--forms: unknown {sorted(unknown)}; known: auto, megamoe")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        argv = json.loads(args.child)
        rank = importlib.import_module("boot_child_sglang" if argv.get("engine") == "sglang" else "boot_child")
        rank.main(argv, START)
        return {}
    import torch

    args.gpus = torch.cuda.device_count()
    args.n = args.n or max(1, args.gpus)
    args.threads = max(1, len(os.sched_getaffinity(0)) // args.n)  # vLLM's startup_omp_num_threads
    args.deadline = time.time() + args.budget_s if args.budget_s else float("inf")
    args.calls = 0
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    from common import node_machine

    results: dict[str, Any] = {"benchmark": "boot", "engine": engine_version(args.engine),
                               "machine": node_machine(args.n, args.threads),
                               "setup": [], "rows": [], "skipped": [], "smoke": args.smoke}

    def save() -> None:
        if args.save:
            args.save.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.save.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1) + "\n")
            tmp.replace(args.save)

    run(args, results, save)
    results["identical"] = identical(results["rows"])
    save()
    print(json.dumps({"benchmark": "boot", "rows": len(results["rows"]), "identical": results["identical"],
                      "skipped": results["skipped"]}))
    return results


def engine_version(engine: str) -> str:
    """``engine==version`` of the engine the ranks import (read off its package, not imported whole)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{engine}=={version(engine)}"
    except PackageNotFoundError:  # an unpacked tree beside its dependencies: its own version module
        pass
    try:
        return f"{engine}=={importlib.import_module(f'{engine}.version').__version__}"
    except ImportError:
        return engine


def identical(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Per shape and rank, whether both forms left the same bytes: the experts' kernel tensors and
    every other parameter."""
    prints: dict[str, set[tuple[str, str]]] = {}
    for row in rows:
        for r in row.get("ranks", []):
            prints.setdefault(f"{row['shape']} rank {r['rank']}", set()).add((r["fingerprint"], r["rest_fingerprint"]))
    return {key: len(v) == 1 for key, v in prints.items()}


if __name__ == "__main__":
    main()
