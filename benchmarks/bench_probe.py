#!/usr/bin/env python3
"""What the layout probe costs at start-up: its time against the first load of a Flash-dims layer, and
the GPU memory it takes against one expert's bytes.

Every measured run is a fresh Python process (``--child``) that builds vLLM's real MegaMoE experts
modules on the GPU (vLLM 0.33's ``DeepGemmMegaMoEExperts``, through ``tests/engines/vllm_harness.py``:
only the SM100 check and the process groups are patched) and installs one rank's layers into them:

  probed      ``install(model, OUT, rank)``: the probe runs vLLM's own ``weight_loader`` on the
              synthetic expert (timed on its own, phase by phase, with the GPU memory it
              allocates) beside the load's first reads, which write nothing until it has passed;
  unprobed    ``install(model, OUT, rank, probe=False)``: the first load alone, the denominator.

The two alternate ``--repeat`` times (each in a fresh process, page cache warm unless ``--cold``).
Reported (medians): the probe's own time; how long the load's lanes waited for it before their
first write (``gate_wait_s``: what the probe adds to a GPU load's critical path); the probed and
unprobed first loads (their difference is the same cost, measured through the runs' noise); its
peak GPU allocation against one expert's bytes (routed, the conversion's format and dims); and
whether every probed run's experts are byte-identical to the unprobed ones.

vLLM comes from ``--vllm PATH``: the folder holding ``vllm/`` (a pip install's ``site-packages``), or
several joined with ``:`` as ``python tests/engine_envs.py vllm==0.33.0`` prints them for the
environment the tests build; everything else is torch and this project.

    PYTHONPATH=.:tests/engines python3 benchmarks/bench_probe.py --vllm PATH --work /tmp/probe --save probe.json
    PYTHONPATH=.:tests/engines python3 benchmarks/bench_probe.py --quick --vllm PATH --work /tmp/x  # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks", REPO / "tests" / "engines"):
    sys.path.insert(0, str(path))


# --------------------------------------------------------------------------------------
# Child: one fresh process, one install
# --------------------------------------------------------------------------------------

def _timed_probe(stats: dict[str, Any], device: Any) -> None:
    """Wrap the probe's run (``engines/probe.check_layout``) to time it and take its GPU peak, and its
    phases (``probe_phases``: the input, this package's layout of it, the engine's code, the comparison)
    to say where its time goes."""
    import dataclasses

    import torch

    from megamoe_convert.engines import probe

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def phase(name: str, fn: Any) -> Any:
        def timed_phase(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                phases = stats.setdefault("probe_phases", {})
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return timed_phase

    for name, attr in (("input", "synthetic_expert"), ("reference", "reference"), ("compare", "difference"),
                       ("fingerprint", "fingerprints")):
        setattr(probe, attr, phase(name, getattr(probe, attr)))
    check = probe.check_layout

    def timed(layout_probe: Any, *args: Any, **kwargs: Any) -> Any:
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            return check(dataclasses.replace(layout_probe, run=phase("engine", layout_probe.run)), *args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
                stats["probe_gpu_bytes"] = max(stats.get("probe_gpu_bytes", 0),
                                               torch.cuda.max_memory_allocated() - before)
            stats["probe_s"] = stats.get("probe_s", 0.0) + time.perf_counter() - start
            stats["probe_calls"] = stats.get("probe_calls", 0) + 1

    probe.check_layout = timed
    _timed_gate(stats)


def _timed_gate(stats: dict[str, Any]) -> None:
    """Wrap the staging's fill to time how long the load's lanes wait for the probe before their first
    write (``gate_wait_s``, the longest wait): the probe runs beside the first reads, so this, not
    its own time, is what it adds to the load on the GPU."""
    import threading

    from megamoe_convert.serve import staging

    fill, lock = staging.fill_device, threading.Lock()

    def timed_fill(ranges: Any, device: Any, before_writes: Any = None) -> None:
        if before_writes is None:
            return fill(ranges, device)

        def gate() -> None:
            start = time.perf_counter()
            try:
                before_writes()
            finally:
                with lock:
                    stats["gate_wait_s"] = max(stats.get("gate_wait_s", 0.0), time.perf_counter() - start)
        return fill(ranges, device, gate)

    staging.fill_device = timed_fill


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import vllm_harness as h

    from megamoe_convert.engines.vllm import install

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
    stats: dict[str, Any] = {}
    probed = args.child == "probed"
    if probed:
        _timed_probe(stats, device)
    config = h.hf_config(Path(args.src))
    with h.patched(args.rank, args.ep_size), torch.device(device):
        model = h.build_main_model(config, args.rank, args.ep_size, 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        install(model, args.out, rank=args.rank, probe=probed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        install_s = time.perf_counter() - start
    experts = h.experts_of(model)
    return {"method": args.child, "install_s": install_s, **stats,
            "fingerprint": _fingerprint([t for m in experts.values() for t in h.kernel_view(m)])}


def _fingerprint(tensors: list[Any]) -> str:
    import torch
    import xxhash

    h = xxhash.xxh3_128()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------

def setup(args: argparse.Namespace) -> dict[str, Any]:
    from common import bench_config, ensure_checkpoint, repo_env

    config = bench_config(args.preset, args.layers, args.experts, 0, 1024)
    synth_s = ensure_checkpoint(args.src, config)
    if not (args.out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "megamoe_convert.cli", "convert", str(args.src), str(args.out),
                        "--ep-size", str(args.ep_size), "--experts-only", "--no-fsync"], check=True, cwd=REPO,
                       env=repo_env())
    return {"config": config, "synth_s": synth_s, "expert_bytes": _one_expert_bytes(args.out),
            "layers": args.layers, "experts": args.experts, "ep_size": args.ep_size, "rank": args.rank}


def _one_expert_bytes(out: Path) -> int:
    """One routed expert's bytes in the conversion's format and dims (its rank-file tensors)."""
    from megamoe_convert.serve.loader import open_converted
    from megamoe_convert.source import formats

    dims = open_converted(out).manifest.dims
    specs = formats.rank_tensor_specs(dims.format, "x", 1, dims.hidden_size, dims.moe_intermediate_size, 1)
    routed = {formats.tensor_names("x")[key] for key in formats.ROUTED_KEYS}
    return sum(s.nbytes for s in specs if s.name in routed)


def spawn(method: str, args: argparse.Namespace) -> dict[str, Any]:
    from common import drop_page_cache

    if args.cold:
        drop_page_cache()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.vllm, str(REPO), str(REPO / "tests" / "engines"),
                                                         os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--child", method, "--src", str(args.src), "--out", str(args.out),
           "--rank", str(args.rank), "--ep-size", str(args.ep_size)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict[str, Any]], expert_bytes: int) -> dict[str, Any]:
    probed = [r for r in runs if r["method"] == "probed"]
    unprobed = [r for r in runs if r["method"] == "unprobed"]
    probe_s = statistics.median(r["probe_s"] for r in probed)
    first_load_s = statistics.median(r["install_s"] for r in unprobed)
    probed_load_s = statistics.median(r["install_s"] for r in probed)
    waits = [r["gate_wait_s"] for r in probed if "gate_wait_s" in r]
    gate_wait_s = statistics.median(waits) if waits else None
    gpu = [r["probe_gpu_bytes"] for r in probed if "probe_gpu_bytes" in r]
    phases = {name: statistics.median(r["probe_phases"].get(name, 0.0) for r in probed)
              for name in sorted({n for r in probed for n in r.get("probe_phases", {})})}
    return {"probe_s": probe_s, "probe_phases_s": phases, "first_load_s": first_load_s,
            "probe_share_of_first_load": probe_s / first_load_s, "gate_wait_s": gate_wait_s,
            "gate_wait_share_of_first_load": gate_wait_s / first_load_s if gate_wait_s is not None else None,
            "probed_first_load_s": probed_load_s, "added_share_of_first_load": probed_load_s / first_load_s - 1,
            "probe_gpu_bytes": max(gpu) if gpu else None, "one_expert_bytes": expert_bytes,
            "probe_gpu_bytes_per_expert": max(gpu) / expert_bytes if gpu else None,
            "identical": len({r["fingerprint"] for r in runs}) == 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", choices=("probed", "unprobed"), help=argparse.SUPPRESS)
    p.add_argument("--vllm", help="PATH of a vLLM 0.33 tree (the folder holding vllm/)")
    p.add_argument("--src", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--work", type=Path, default=Path("/tmp/megamoe-probe"))
    p.add_argument("--preset", default="flash")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--experts", type=int, default=64, help="routed experts (64 at EP 2: Flash's 32 per rank)")
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each child (root)")
    p.add_argument("--save")
    p.add_argument("--quick", action="store_true", help="the tiny preset, one repetition: seconds on the CPU")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.layers, args.experts, args.ep_size, args.repeat = "tiny", 1, 8, 2, 1
    args.src = args.src or args.work / f"src-{args.preset}-{args.layers}x{args.experts}"
    args.out = args.out or args.work / f"out-{args.preset}-{args.layers}x{args.experts}-ep{args.ep_size}"
    if not args.child and not args.vllm:
        p.error("--vllm PATH is required (a vLLM 0.33 tree: the folder holding vllm/)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        result = child(args)
        print(json.dumps(result))
        return result
    import torch

    summary: dict[str, Any] = {"setup": setup(args), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                               else None, "cold": args.cold}
    runs = [spawn(method, args) for _ in range(args.repeat) for method in ("unprobed", "probed")]
    summary.update(runs=runs, **summarize(runs, summary["setup"]["expert_bytes"]))
    if args.save:
        Path(args.save).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("runs", "setup")}))
    return summary


if __name__ == "__main__":
    main()
