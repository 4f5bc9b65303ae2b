#!/usr/bin/env python3
"""What a server pays at start-up: the first load of a rank's MegaMoE experts, in a fresh process,
against the engines' real loading code.

Every measured run is a new Python process (``--child``) that imports, builds vLLM's real
MegaMoE expert modules on the GPU (``DeepGemmMegaMoEExperts`` of vLLM 0.33, or 0.32's
``DeepseekV4MegaMoEExperts``, through ``tests/engines/vllm_harness.py``: only the SM100 check
and the process groups are patched) and loads them once:

  ours          ``megamoe_convert.engines.vllm.install(model, OUT, rank)``: each layer
                read straight into the module's parameters;
  vllm033       vLLM 0.33's own path: ``safetensors_weights_iterator`` over the source
                checkpoint in file order -> the model's ``load_weights`` (its own name
                mapping) -> the experts' ``weight_loader``; ``_ep_filter`` passes the rank's
                local expert ids (``--enable-ep-weight-filter``), ``_all`` does not;
  vllm032       vLLM 0.32's own path: the same, then ``finalize_weights`` (DeepGEMM's bundled
                ``transform_weights_for_mega_moe`` on the GPU; its SM100-only C++ scale transform
                replaced by the project's spec-exact equivalent, also on the GPU).

Each child reports import time, module build time, the first load's time (the figure a server
pays), bytes read from storage (``/proc/self/io``), peak host RSS, peak GPU memory, and a
checksum of what the kernel will read, so every path's result is checked to be identical.
Warm: every file in the page cache first; cold: ``drop_caches`` before the child starts.
Node: one child per GPU, all started at once (``--node``), wall time from the first start to the
last end. The same run measures the limits: a parallel read of the rank's files from disk, the
page cache -> pinned memory copy, and a pinned host -> device copy.

    PYTHONPATH=.:tests/engines python3 benchmarks/bench_startup.py --smoke --work /tmp/x --vllm 0.33=PATH  # seconds
    PYTHONPATH=.:tests/engines python3 benchmarks/bench_startup.py --work /tmp/startup \\
        --vllm 0.33=/path/to/vllm-0.33 --vllm 0.32=/path/to/vllm-0.32 --save results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks", REPO / "tests" / "engines"):
    sys.path.insert(0, str(path))

#: method -> (vLLM release whose modules it loads into, whose code loads, EP filter, redundant experts)
METHODS = {
    "ours": ("0.33", "install", False, False),
    "vllm033_all": ("0.33", "vllm", False, False),
    "vllm033_ep_filter": ("0.33", "vllm", True, False),
    "ours_v032": ("0.32", "install", False, False),
    "vllm032": ("0.32", "vllm", False, False),
    # With redundant (EPLB) experts vLLM turns its EP weight filter off: every rank reads all.
    "ours_redundant": ("0.33", "install", False, True),
    "vllm033_redundant": ("0.33", "vllm", False, True),
}


# --------------------------------------------------------------------------------------
# Child: one fresh process, one first load
# --------------------------------------------------------------------------------------

def io_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``: reset by exec, unlike ``ru_maxrss``, which a child
    inherits from the parent that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fingerprint(tensors: list[Any]) -> str:
    """xxh3-128 of the bytes the kernel reads (scales in their storage order), after timing."""
    import xxhash

    from megamoe_convert.layout import scales

    h = xxhash.xxh3_128()
    for t in tensors:
        storage = scales.sf_storage(t) if t.dim() == 3 and not t.is_contiguous() else t
        h.update(storage.contiguous().cpu().view(-1).view(__import__("torch").uint8).numpy())  # hashed in place
    return h.hexdigest()


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import vllm_harness as h

    from megamoe_convert.engines.vllm import install
    from megamoe_convert.serve.staging import prepare_gpu_staging

    _, code, ep_filter, with_redundant = METHODS[args.child]
    redundant = args.redundant if with_redundant else 0
    imported = time.perf_counter()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    cuda_ready = time.perf_counter()
    if code == "install":
        prepare_gpu_staging(out_dir(args, with_redundant))  # what --load-format megamoe does as vLLM builds it
    config = h.hf_config(Path(args.src))
    with h.patched(args.rank, args.ep_size), torch.device(device):
        model = h.build_main_model(config, args.rank, args.ep_size, redundant)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        built, built_unix = time.perf_counter(), time.time()
        read_before = io_read_bytes()
        if code == "install":
            install(model, out_dir(args, with_redundant), rank=args.rank)
        else:
            ids = None
            if ep_filter:
                local = config.n_routed_experts // args.ep_size
                ids = set(range(args.rank * local, (args.rank + 1) * local))
            model.load_weights(expert_weights(Path(args.src), ids))  # 0.30-0.32 finalize in there
        if device.type == "cuda":
            torch.cuda.synchronize()
        loaded, loaded_unix = time.perf_counter(), time.time()
    experts = h.experts_of(model)
    return {
        "method": args.child, "rank": args.rank, "vllm": h.vllm.__version__, "redundant": redundant,
        "import_s": imported - START, "cuda_init_s": cuda_ready - imported, "build_s": built - cuda_ready,
        "load_s": loaded - built, "process_s": loaded - START,
        "start_unix": loaded_unix - (loaded - START), "end_unix": loaded_unix,
        "load_start_unix": built_unix, "load_end_unix": loaded_unix,
        "read_bytes": io_read_bytes() - read_before,
        "peak_rss_mb": peak_rss_mb(),
        "gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        "fingerprint": fingerprint([t for m in experts.values() for t in h.kernel_view(m)]),
    }


def expert_weights(src: Path, local_expert_ids: set[int] | None):
    """vLLM's own iterator (with its EP filter when ids are given), every tensor in file order;
    only routed-expert tensors reach the model tree (it holds no attention layers)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in src.glob("*.safetensors"))
    kwargs = {} if local_expert_ids is None else {"local_expert_ids": local_expert_ids}
    for name, tensor in safetensors_weights_iterator(files, False, **kwargs):
        if ".ffn.experts." in name:
            yield name, tensor


# --------------------------------------------------------------------------------------
# Parent: set-up, limits, scenarios
# --------------------------------------------------------------------------------------

def warm(paths: list[Path]) -> None:
    from bench_load import HostRead

    HostRead(paths, 16, 16 << 20).run()


def rank_files(out: Path, rank: int) -> list[Path]:
    return sorted(out.glob(f"rank-{rank:05d}-of-*/*.safetensors"))


def out_dir(args: argparse.Namespace, redundant: bool) -> Path:
    return args.out.with_name(f"{args.out.name}-r{args.redundant}") if redundant else args.out


def gpu_count() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def spawn(method: str, args: argparse.Namespace, rank: int, gpu: int) -> subprocess.Popen:
    engine = args.vllm[METHODS[method][0]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([engine, str(REPO), str(REPO / "tests" / "engines"),
                                                         os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": str(gpu)}
    cmd = [sys.executable, __file__, "--child", method, "--src", str(args.src), "--out", str(args.out),
           "--rank", str(rank), "--ep-size", str(args.ep_size), "--redundant", str(args.redundant)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(procs: list[subprocess.Popen]) -> list[dict[str, Any]]:
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"child failed ({proc.returncode}):\n{err[-4000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def scenario(method: str, cache: str, ranks: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """One method, warm or cold, on ``ranks`` started at the same moment, one GPU each (ranks
    share GPUs round-robin when there are more ranks than GPUs: a labelled stress)."""
    from common import drop_page_cache  # parent only: children time their own imports

    out = out_dir(args, METHODS[method][3])
    everything = sorted(args.src.glob("*.safetensors")) + [f for r in ranks for f in rank_files(out, r)]
    dropped = drop_page_cache() if cache == "cold" else warm(everything)
    gpus = gpu_count()
    runs = collect([spawn(method, args, rank, i % gpus) for i, rank in enumerate(ranks)])
    wall = max(r["end_unix"] for r in runs) - min(r["start_unix"] for r in runs)
    load_wall = max(r["load_end_unix"] for r in runs) - min(r["load_start_unix"] for r in runs)
    return {"method": method, "cache": cache, "ranks": ranks, "gpus": gpus,
            "ranks_per_gpu": -(-len(ranks) // gpus), "dropped": dropped, "node_wall_s": wall,
            "node_load_wall_s": load_wall,
            "node_read_bytes": sum(r["read_bytes"] for r in runs), "runs": runs,
            "tunables": {k: v for k, v in os.environ.items() if k.startswith("MEGAMOE_")}}


def limits(args: argparse.Namespace, ranks: list[int]) -> dict[str, Any]:
    import torch
    from bench_load import H2D, HostRead
    from common import drop_page_cache

    files = [f for r in ranks for f in rank_files(args.out, r)]
    nbytes = sum(f.stat().st_size for f in files)
    result: dict[str, Any] = {"rank_bytes": nbytes}
    for threads, piece in ((16, 16 << 20), (64, 4 << 20)):
        drop_page_cache()
        reader = HostRead(files, threads, piece)
        start = time.perf_counter()
        reader.run()
        result[f"disk_parallel_read_gbps_t{threads}"] = nbytes / (time.perf_counter() - start) / 1e9
    result["disk_parallel_read_gbps"] = max(v for k, v in result.items() if k.startswith("disk_parallel_read_gbps_"))
    reader = HostRead(files, 16, 16 << 20)
    reader.run()
    start = time.perf_counter()
    reader.run()
    result["pagecache_to_pinned_gbps"] = nbytes / (time.perf_counter() - start) / 1e9
    if torch.cuda.is_available():
        h2d = H2D(min(nbytes, 4 << 30), torch.device("cuda", 0))
        h2d.pinned_copy()
        start = time.perf_counter()
        h2d.pinned_copy()
        result["pinned_h2d_gbps"] = h2d.pinned.numel() / (time.perf_counter() - start) / 1e9
    return result


def setup(args: argparse.Namespace) -> dict[str, Any]:
    from common import bench_config, ensure_checkpoint, repo_env

    config = bench_config(args.preset, args.layers, args.experts, 0, 1024)
    synth_s = ensure_checkpoint(args.src, config)
    start = time.perf_counter()
    outs = [(args.out, 0)] + ([(out_dir(args, True), args.redundant)] if args.redundant else [])
    for out, redundant in outs:
        if not (out / "manifest.json").exists():
            subprocess.run([sys.executable, "-m", "megamoe_convert.cli", "convert", str(args.src), str(out),
                            "--ep-size", str(args.ep_size), "--experts-only", "--no-fsync",
                            "--num-redundant-experts", str(redundant)], check=True, cwd=REPO,
                           env=repo_env())
    expert_bytes = sum(f.stat().st_size for f in args.out.glob("rank-*/*.safetensors"))
    return {"config": config, "synth_s": synth_s, "convert_s": time.perf_counter() - start,
            "expert_bytes": expert_bytes, "source_bytes": sum(f.stat().st_size for f in args.src.glob("*.safetensors"))}


def machine() -> dict[str, Any]:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpus": gpus, "cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]}


def identical(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Per model shape (with or without redundant experts), whether every method's fingerprint agrees."""
    groups: dict[str, set[str]] = {}
    for row in rows:
        for r in row["runs"]:
            groups.setdefault(f"redundant={r['redundant']}", set()).add(r["fingerprint"])
    return {shape: len(prints) == 1 for shape, prints in groups.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", choices=list(METHODS), help=argparse.SUPPRESS)
    p.add_argument("--src", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--work", type=Path, default=Path("/tmp/megamoe-startup"))
    p.add_argument("--preset", default="flash")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--redundant", type=int, default=0, help="redundant experts for the *_redundant methods")
    p.add_argument("--methods", default="ours,vllm033_all,vllm033_ep_filter,ours_v032,vllm032")
    p.add_argument("--node-methods", default="ours,vllm033_all,vllm033_ep_filter")
    p.add_argument("--caches", default="warm,cold")
    p.add_argument("--node", type=int, default=0, help="also run ranks 0..N-1 at once, one per GPU")
    p.add_argument("--vllm", action="append", default=[], help="VERSION=PATH of a vLLM tree (0.33, 0.32)")
    p.add_argument("--save")
    p.add_argument("--smoke", action="store_true", help="the tiny preset, warm, ours and vLLM 0.33's own path "
                                                       "only: seconds on the CPU (CI runs it in vLLM 0.33's env)")
    args = p.parse_args(argv)
    args.vllm = dict(v.split("=", 1) for v in args.vllm)
    if args.smoke:
        args.preset, args.layers, args.experts, args.ep_size, args.node = "tiny", 1, 8, 2, 0
        args.caches, args.methods, args.redundant = "warm", "ours,vllm033_all", 0
    args.src = args.src or args.work / "src"
    args.out = args.out or args.work / f"ep{args.ep_size}"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        result = child(args)
        print(json.dumps(result))
        return result
    summary: dict[str, Any] = {"setup": setup(args), "ep_size": args.ep_size, "machine": machine()}
    print(json.dumps(summary["setup"]), flush=True)
    summary["limits_rank"] = limits(args, [args.rank])
    print(json.dumps(summary["limits_rank"]), flush=True)
    methods = args.methods.split(",")
    summary["single"] = []
    for cache in args.caches.split(","):
        for method in methods:
            row = scenario(method, cache, [args.rank], args)
            summary["single"].append(row)
            r = row["runs"][0]
            print(f"{cache:5s} {method:18s} load {r['load_s']:.3f}s build {r['build_s']:.2f}s import "
                  f"{r['import_s']:.2f}s read {r['read_bytes'] / 1e9:.2f} GB rss {r['peak_rss_mb']:.0f} MB gpu "
                  f"{r['gpu_peak_mb'] or 0:.0f} MB {r['fingerprint'][:12]}", flush=True)
    if args.node > 1:
        summary["limits_node"] = limits(args, list(range(args.node)))
        print(json.dumps(summary["limits_node"]), flush=True)
        summary["node"] = []
        for cache in args.caches.split(","):
            for method in args.node_methods.split(","):
                row = scenario(method, cache, list(range(args.node)), args)
                summary["node"].append(row)
                print(f"node {cache:5s} {method:18s} {len(row['ranks'])} ranks on {row['gpus']} GPU(s): wall "
                      f"{row['node_wall_s']:.2f}s (loads {row['node_load_wall_s']:.2f}s) "
                      f"read {row['node_read_bytes'] / 1e9:.2f} GB, slowest load "
                      f"{max(r['load_s'] for r in row['runs']):.2f}s", flush=True)
    summary["identical"] = identical(summary["single"])
    print(f"identical results across methods: {summary['identical']}", flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
