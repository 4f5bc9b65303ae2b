#!/usr/bin/env python3
"""What a server pays at start-up: the first load of a rank's MegaMoE experts, in a fresh process,
against the engines' real loading code.

Every measured run is a new Python process (``--child``) that imports, builds vLLM's real
MegaMoE expert modules on the GPU (``DeepGemmMegaMoEExperts`` of vLLM 0.33, or 0.32's
``DeepseekV4MegaMoEExperts``, through ``tests/engines/vllm_harness.py``: only the SM100 check
and the process groups are patched) and loads them once:

  ours          ``megamoe_convert.vllm_integration.install(model, OUT, rank)``: each layer
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

METHODS = ("ours", "vllm033_all", "vllm033_ep_filter", "vllm032")


# --------------------------------------------------------------------------------------
# Child: one fresh process, one first load
# --------------------------------------------------------------------------------------

def io_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def fingerprint(tensors: list[Any]) -> str:
    """xxh3-128 of the bytes the kernel reads (scales in their storage order), after timing."""
    import xxhash

    from megamoe_convert import layout

    h = xxhash.xxh3_128()
    for t in tensors:
        storage = layout.sf_storage(t) if t.dim() == 3 and not t.is_contiguous() else t
        h.update(storage.contiguous().cpu().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def child(args: argparse.Namespace) -> dict[str, Any]:
    import resource

    import torch

    import vllm_harness as h
    from megamoe_convert.vllm_integration import install

    imported = time.perf_counter()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    cuda_ready = time.perf_counter()
    config = h.hf_config(Path(args.src))
    with h.patched(args.rank, args.ep_size), torch.device(device):
        model = h.build_main_model(config, args.rank, args.ep_size, 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        built = time.perf_counter()
        read_before = io_read_bytes()
        if args.child == "ours":
            install(model, args.out, rank=args.rank)
        else:
            ids = None
            if args.child.endswith("ep_filter"):
                local = config.n_routed_experts // args.ep_size
                ids = set(range(args.rank * local, (args.rank + 1) * local))
            model.load_weights(expert_weights(Path(args.src), ids))  # 0.30-0.32 finalize in there
        if device.type == "cuda":
            torch.cuda.synchronize()
        loaded = time.perf_counter()
    experts = h.experts_of(model)
    return {
        "method": args.child, "rank": args.rank, "vllm": h.vllm.__version__,
        "import_s": imported - START, "cuda_init_s": cuda_ready - imported, "build_s": built - cuda_ready,
        "load_s": loaded - built, "process_s": loaded - START,
        "start_unix": time.time() - (loaded - START), "end_unix": time.time(),
        "read_bytes": io_read_bytes() - read_before,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
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


def spawn(method: str, args: argparse.Namespace, rank: int, gpu: int) -> subprocess.Popen:
    engine = args.vllm["0.32" if method == "vllm032" else "0.33"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([engine, str(REPO), str(REPO / "tests" / "engines"),
                                                         os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": str(gpu)}
    cmd = [sys.executable, __file__, "--child", method, "--src", str(args.src), "--out", str(args.out),
           "--rank", str(rank), "--ep-size", str(args.ep_size)]
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
    """One method, warm or cold, on ``ranks`` (one GPU each) started at the same moment."""
    from bench_convert import drop_page_cache  # parent only: children time their own imports

    everything = sorted(args.src.glob("*.safetensors")) + [f for r in ranks for f in rank_files(args.out, r)]
    dropped = drop_page_cache() if cache == "cold" else warm(everything)
    runs = collect([spawn(method, args, rank, gpu) for gpu, rank in enumerate(ranks)])
    wall = max(r["end_unix"] for r in runs) - min(r["start_unix"] for r in runs)
    return {"method": method, "cache": cache, "ranks": ranks, "dropped": dropped, "node_wall_s": wall,
            "node_read_bytes": sum(r["read_bytes"] for r in runs), "runs": runs}


def limits(args: argparse.Namespace, ranks: list[int]) -> dict[str, Any]:
    import torch

    from bench_convert import drop_page_cache
    from bench_load import H2D, HostRead

    files = [f for r in ranks for f in rank_files(args.out, r)]
    nbytes = sum(f.stat().st_size for f in files)
    result: dict[str, Any] = {"rank_bytes": nbytes}
    drop_page_cache()
    reader = HostRead(files, 16, 16 << 20)
    start = time.perf_counter()
    reader.run()
    result["disk_parallel_read_gbps"] = nbytes / (time.perf_counter() - start) / 1e9
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
    from bench_convert import bench_config, ensure_checkpoint

    config = bench_config(args.preset, args.layers, args.experts, 0, 1024)
    synth_s = ensure_checkpoint(args.src, config)
    start = time.perf_counter()
    if not (args.out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "megamoe_convert.cli", "convert", str(args.src), str(args.out),
                        "--ep-size", str(args.ep_size), "--experts-only", "--no-fsync"], check=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    expert_bytes = sum(f.stat().st_size for f in args.out.glob("rank-*/*.safetensors"))
    return {"config": config, "synth_s": synth_s, "convert_s": time.perf_counter() - start,
            "expert_bytes": expert_bytes, "source_bytes": sum(f.stat().st_size for f in args.src.glob("*.safetensors"))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--src", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--work", type=Path, default=Path("/tmp/megamoe-startup"))
    p.add_argument("--preset", default="flash")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--caches", default="warm,cold")
    p.add_argument("--node", type=int, default=0, help="also run ranks 0..N-1 at once, one per GPU")
    p.add_argument("--vllm", action="append", default=[], help="VERSION=PATH of a vLLM tree (0.33, 0.32)")
    p.add_argument("--save")
    args = p.parse_args(argv)
    args.vllm = dict(v.split("=", 1) for v in args.vllm)
    args.src = args.src or args.work / "src"
    args.out = args.out or args.work / f"ep{args.ep_size}"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        result = child(args)
        print(json.dumps(result))
        return result
    summary: dict[str, Any] = {"setup": setup(args), "ep_size": args.ep_size}
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
            print(f"{cache:5s} {method:18s} load {r['load_s']:.3f}s import {r['import_s']:.2f}s read "
                  f"{r['read_bytes'] / 1e9:.2f} GB rss {r['peak_rss_mb']:.0f} MB gpu {r['gpu_peak_mb']} MB "
                  f"{r['fingerprint'][:12]}", flush=True)
    if args.node > 1:
        summary["limits_node"] = limits(args, list(range(args.node)))
        summary["node"] = [scenario(m, c, list(range(args.node)), args)
                           for c in args.caches.split(",") for m in methods]
    prints = {(row["runs"][0]["method"]): row["runs"][0]["fingerprint"] for row in summary["single"]}
    summary["identical"] = len(set(prints.values())) == 1
    print(f"identical results across methods: {summary['identical']} {prints}", flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
