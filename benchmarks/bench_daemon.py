#!/usr/bin/env python3
"""vLLM 0.33's weight-cache daemon, timed: a daemon's cold start from the pre-baked shards
(``megamoe preload``: ``--load-format megamoe`` in the daemon) against one from the source with
vLLM's own path (``vllm preload --model SRC``: ``DefaultModelLoader`` -> the model's
``load_weights`` -> the experts' ``weight_loader``), an engine restart through
``--load-format ipc_cache`` mapping a daemon's experts, and ``install()``'s first call beside them.

Every role is a fresh process (``--role``), each timed from its own start:

  daemon    vLLM's own ``WeightCacheDaemon`` on vLLM's own config: ``get_model`` with the
            configured loader (the model's GPU constructor replaced by the MegaMoE modules of
            ``tests/engines/vllm_harness.py`` on the GPU), then ``serve_forever`` on a Unix socket;
            it reports when its socket is bound (what ``vllm preload`` waits for);
  engine    vLLM's own ``IpcModelLoader`` (megamoe-convert's, registered): the model on ``meta``,
            the daemon's tensors mapped over CUDA IPC (on a CPU they travel by value), vLLM's
            ``process_weights_after_loading`` in pre-processed mode; no fallback allowed;
  install   the modules built on the GPU, then ``install(model, OUT, rank)``.

Patched, as in the tests: what needs vLLM's CUDA platform (its IPC platform check, the device
UUID), the process groups, and the model's constructor. Every role ends with a checksum of what
the kernel reads: all must be equal.

    PYTHONPATH=/path/to/vllm-0.33 python3 benchmarks/bench_daemon.py --work /tmp/daemon --save r.json
    python3 benchmarks/bench_daemon.py --smoke        # tiny, on the CPU (a test runs it)

``--smoke`` times nothing: its roles' processes are forked from one that imported vLLM once
(``node_zygote.py``), each still a process of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

START = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "benchmarks", REPO / "tests" / "engines"):
    sys.path.insert(0, str(path))

from node_procs import launch  # noqa: E402
from node_zygote import forking  # noqa: E402

# --------------------------------------------------------------------------------------
# Children
# --------------------------------------------------------------------------------------

def device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def tree(args: argparse.Namespace, on: Any = None):
    """The MegaMoE model tree of vLLM's own classes (on the device ``on``, else the current default:
    ``meta`` in the engine); its ``load_weights`` gets what vLLM's loader reads, routed experts only
    (the tree holds no attention or dense layers)."""
    import torch
    import vllm_harness as h

    with torch.device(on) if on is not None else contextlib.nullcontext():
        model = h.build_main_model(h.hf_config(Path(args.model)), args.rank, args.ep_size, 0)
    real = model.load_weights

    def load_weights(weights):
        real((name, t) for name, t in weights if ".ffn.experts." in name)
        return None

    model.load_weights = load_weights
    return model


def patches(args: argparse.Namespace):
    """The tests' patches (``vllm_harness.weight_cache_patched``) for this rank."""
    import vllm_harness as h

    return h.weight_cache_patched(args.rank, args.ep_size)


def vllm_config(model: str, **load):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, **load).create_engine_config()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_fingerprint(model) -> str:
    import vllm_harness as h
    from bench_startup import fingerprint

    return fingerprint([t for m in h.experts_of(model).values() for t in h.kernel_view(m)])


def role_daemon(args: argparse.Namespace) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.plugins import load_general_plugins

    from megamoe_convert.engines.vllm.preload import prepare_daemon

    prebaked = (Path(args.model) / "manifest.json").exists()
    if prebaked:
        prepare_daemon()  # what megamoe preload's daemon entry does first
    else:
        load_general_plugins()  # vllm preload's daemons do not; the same cost either way
    from vllm.model_executor.model_loader.weight_cache import daemon as daemon_py
    from vllm.model_executor.model_loader.weight_cache import protocol
    imported = time.perf_counter()
    dev = device()
    if dev.type == "cuda":
        torch.empty(1, device=dev)
    with patches(args):
        config = vllm_config(args.model, load_format="megamoe" if prebaked else "auto")
        daemon = daemon_py.WeightCacheDaemon(config, global_rank=0, local_rank=0, distributed_init_method="",
                                             socket_dir=args.socket_dir)
        configured = time.perf_counter()
        # vLLM's get_model builds under its configured device (the CPU platform's): the GPU explicitly
        build = lambda self, vllm_config, model_config, prefix="": tree(args, dev)  # noqa: E731
        with set_current_vllm_config(config), \
                mock.patch("vllm.model_executor.model_loader.base_loader.BaseModelLoader.create_model", build):
            daemon.model = daemon.get_model()
        sync()
        loaded = time.perf_counter()
        daemon.loaded_rope_parameters_hash = protocol.hash_rope_parameters(daemon.model_config)
        report = {"role": "daemon", "from": "prebaked" if prebaked else "source", "import_s": imported - START,
                  "config_s": configured - imported, "load_s": loaded - configured,
                  "fingerprint": kernel_fingerprint(daemon.model),
                  "gpu_mb": torch.cuda.memory_allocated() / 2**20 if dev.type == "cuda" else None}

        def ready() -> None:
            report["ready_s"] = time.perf_counter() - START
            print(json.dumps(report), flush=True)

        daemon.serve_forever(ready_callback=ready)  # until the parent ends it


def role_engine(args: argparse.Namespace) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    # The entry point's own call, for a checkout run without `pip install` (no entry points there):
    # an engine with megamoe-convert installed runs it through load_general_plugins above.
    from megamoe_convert.engines.vllm.plugin import register

    register()
    from vllm.model_executor.model_loader.weight_cache import ipc_loader
    imported = time.perf_counter()
    if device().type == "cuda":
        torch.empty(1, device=device())
    with patches(args):
        config = vllm_config(args.model, load_format="ipc_cache",
                             model_loader_extra_config={"socket_dir": args.socket_dir, "fallback": False})
        loader = get_model_loader(config.load_config)
        configured = time.perf_counter()
        build = lambda vllm_config, model_config, prefix="": tree(args)  # noqa: E731
        with set_current_vllm_config(config), mock.patch.object(ipc_loader, "initialize_model", build):
            model = loader.load_model(config, config.model_config)
        sync()
        mapped = time.perf_counter()
    print(json.dumps({"role": "engine", "import_s": imported - START, "config_s": configured - imported,
                      "map_s": mapped - configured, "process_s": mapped - START,
                      "fingerprint": kernel_fingerprint(model)}), flush=True)


def role_install(args: argparse.Namespace) -> None:
    import torch
    import vllm_harness  # noqa: F401  (vLLM's modules: imported, as in the other roles, before the clock)

    from megamoe_convert.engines.vllm import install
    from megamoe_convert.serve.staging import prepare_gpu_staging

    imported = time.perf_counter()
    dev = device()
    if dev.type == "cuda":
        torch.empty(1, device=dev)
    prepare_gpu_staging(args.model)
    with patches(args):
        model = tree(args, dev)
        sync()
        built = time.perf_counter()
        install(model, args.model, rank=args.rank)
        sync()
        loaded = time.perf_counter()
    print(json.dumps({"role": "install", "import_s": imported - START, "build_s": built - imported,
                      "load_s": loaded - built, "process_s": loaded - START,
                      "fingerprint": kernel_fingerprint(model)}), flush=True)


# --------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------

def spawn(role: str, model: Path, args: argparse.Namespace, socket_dir: str) -> subprocess.Popen:
    """A child; its stderr (vLLM's progress bars, warnings) goes to a file, never a pipe that fills."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(REPO),
                                                         str(REPO / "tests" / "engines")])}
    cmd = [sys.executable, __file__, "--role", role, "--model", str(model), "--rank", str(args.rank),
           "--ep-size", str(args.ep_size), "--socket-dir", socket_dir]
    err = open(args.work / f"{role}-{time.time_ns()}.err", "w")
    proc = launch(cmd, env, err, False)  # forked from one import of vLLM in --smoke (node_zygote.py)
    proc.err_path = err.name  # type: ignore[attr-defined]
    return proc


def first_json(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """The child's JSON report (a daemon goes on serving after it: its stdout is drained on)."""
    box: list[str] = []
    got = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("{") and not box:
                box.append(line)
                got.set()
        got.set()

    threading.Thread(target=read, daemon=True).start()
    got.wait(timeout)
    if not box:
        proc.kill()
        raise RuntimeError(f"{proc.args[3]} gave no report:\n{Path(proc.err_path).read_text()[-4000:]}")  # type: ignore
    return json.loads(box[0])


def run_once(role: str, model: Path, args: argparse.Namespace, socket_dir: str) -> dict[str, Any]:
    proc = spawn(role, model, args, socket_dir)
    report = first_json(proc, args.timeout)
    proc.wait(args.timeout)
    return report


def drop_caches(cold: bool) -> bool:
    if not cold:
        return False
    from common import drop_page_cache

    return drop_page_cache()


def setup(args: argparse.Namespace) -> dict[str, Any]:
    from common import bench_config, ensure_checkpoint, repo_env

    config = bench_config(args.preset, args.layers, args.experts, 0, 1024)
    if args.smoke:
        config["moe_intermediate_size"] = 512
    synth_s = ensure_checkpoint(args.src, config)
    if not (args.out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "megamoe_convert.cli", "convert", str(args.src), str(args.out),
                        "--ep-size", str(args.ep_size), "--no-fsync"], check=True, cwd=REPO, capture_output=True,
                       env=repo_env())
    return {"config": config, "synth_s": synth_s,
            "rank_bytes": sum(f.stat().st_size for f in args.out.glob(f"rank-{args.rank:05d}-of-*/*")),
            "source_bytes": sum(f.stat().st_size for f in args.src.glob("*.safetensors"))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["daemon", "engine", "install"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--socket-dir", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, default=Path("/tmp/megamoe-daemon"))
    p.add_argument("--preset", default="flash")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ep-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each daemon (root)")
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--smoke", action="store_true", help="tiny preset, one repeat (CPU is fine)")
    p.add_argument("--save")
    args = p.parse_args(argv)
    if args.role:
        {"daemon": role_daemon, "engine": role_engine, "install": role_install}[args.role](args)
        return {}
    if args.smoke:
        args.preset, args.layers, args.experts, args.ep_size, args.repeats = "tiny", 2, 8, 4, 1
    args.src, args.out = args.work / "src", args.work / f"out-ep{args.ep_size}"
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        return run(args)
    with forking("vllm", args.work):  # a smoke run times nothing: one import of vLLM for every role
        return run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each role's runs, the daemons' from the conversion and from the source, and their kernel views."""
    result: dict[str, Any] = {"setup": setup(args), "rank": args.rank, "ep_size": args.ep_size, "cold": args.cold,
                              "runs": []}
    for _ in range(args.repeats):
        for model in (args.out, args.src):
            socket_dir = tempfile.mkdtemp(prefix="wc", dir="/tmp")
            dropped = drop_caches(args.cold)
            daemon = spawn("daemon", model, args, socket_dir)
            try:
                run = {"daemon": first_json(daemon, args.timeout), "dropped": dropped}
                if model == args.out:  # an engine restart mapping that daemon's experts
                    run["engine"] = run_once("engine", model, args, socket_dir)
            finally:
                daemon.kill()
                daemon.wait()
            result["runs"].append(run)
        drop_caches(args.cold)
        result["runs"].append({"install": run_once("install", args.out, args, "-")})
    prints = {r[k]["fingerprint"] for r in result["runs"] for k in ("daemon", "engine", "install") if k in r}
    result["identical"] = len(prints) == 1
    if args.save:
        Path(args.save).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary(result), indent=1))
    if not result["identical"]:
        raise SystemExit("the roles' kernel views differ")
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per role, the best of the repeats."""
    best: dict[str, dict[str, float]] = {}
    for run in result["runs"]:
        for key, report in run.items():
            if not isinstance(report, dict):
                continue
            name = f"daemon_{report['from']}" if key == "daemon" else key
            for field, value in report.items():
                if field.endswith("_s"):
                    best.setdefault(name, {})[field] = min(value, best.get(name, {}).get(field, float("inf")))
    return {"identical": result["identical"], "best": best}


if __name__ == "__main__":
    main()
