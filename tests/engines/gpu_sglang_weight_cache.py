#!/usr/bin/env python3
"""SGLang 0.5.23's weight-cache daemon and an engine restart mapping it, in two processes: on a GPU,
through real CUDA IPC handles (``--device cuda``); on the CPU (``--device cpu``, the test suite's
run), through torch's shared CPU memory.

A tiny DeepSeek-V4 checkpoint (hidden 512, SGLang's MegaMoE rule) is synthesised and converted for
SGLang (EP 4, 4 redundant experts) under ``--work``; a daemon process loads rank ``--rank`` of it as
``megamoe preload`` does (SGLang's ``WeightCacheDaemon``, its default loader through the plugin's
hooked ``load_weights``, its export and server: ``test_sglang_weight_cache.daemon_up``); this
process then loads the same rank with SGLang's ``IpcModelLoader`` (``--weight-cache-mode client``),
and every MegaMoE tensor it maps must equal SGLang's own loading of the source, byte for byte. Prints
one JSON line; exits 1 when a byte differs.

    PYTHONPATH=SGLANG_ENV:. python tests/engines/gpu_sglang_weight_cache.py --device cuda --work /tmp/swc
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))
sys.path.insert(2, str(Path(__file__).resolve().parents[1]))  # the tests' shared helpers

import torch  # noqa: E402

#: SGLang imported while CUDA answers no, as on the CPU machine its tests run on: it then imports none of
#: its compiled kernels (``sgl_kernel``, which this run does not carry), settles on its CPU platform and
#: caches its CUDA checks as false; the tensors, the daemon's export and the mapping still use the GPU.
_cuda_available = torch.cuda.is_available
torch.cuda.is_available = lambda: False
try:
    import sglang_harness as h  # noqa: E402  (first: its torchvision stand-in)
    import test_sglang_model_classes  # noqa: E402, F401
    import test_sglang_weight_cache  # noqa: E402, F401
    from sglang.srt.utils.common import is_cuda, is_cuda_alike  # noqa: E402

    is_cuda(), is_cuda_alike()  # cached while CUDA is hidden
finally:
    torch.cuda.is_available = _cuda_available

EP_SIZE, REDUNDANT = 4, 4


def build(work: Path) -> tuple[Path, Path]:
    """The checkpoint and its conversion for SGLang (reused when already there)."""
    from megamoe_convert.convert import ConvertOptions, convert
    from megamoe_convert.synth.write import synthesize

    ckpt, out = work / "ckpt", work / "sglang-ep4"
    if not (ckpt / "config.json").exists():
        (work / "preset.json").write_text(json.dumps(h.CONFIG))
        synthesize(ckpt, str(work / "preset.json"), seed=2)
    if not (out / "manifest.json").exists():
        convert(ckpt, out, ConvertOptions(ep_size=EP_SIZE, num_redundant_experts=REDUNDANT, engine="sglang"))
    return ckpt, out


def environment(stack: ExitStack, sockets: Path, device: str) -> None:
    """SGLang's socket and ready-file templates, and the device UUID they name (SGLang's CPU platform,
    which it settled on, has none)."""
    os.environ["SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"] = f"{sockets}/{{device_uuid}}.sock"
    os.environ["SGLANG_WEIGHT_CACHE_READY_TEMPLATE"] = f"{sockets}/{{device_uuid}}.ready"
    from sglang.srt.platforms import current_platform

    stack.enter_context(mock.patch.object(current_platform, "get_device_uuid", lambda device_id=0: "gpu0"))


def daemon_main(ckpt: Path, out: Path, rank: int, device: str, sockets: Path) -> None:
    """The daemon's process: loads and serves until terminated."""
    import test_sglang_weight_cache as t

    with ExitStack() as stack:
        environment(stack, sockets, device)
        args = stack.enter_context(h.patched(rank, EP_SIZE, REDUNDANT))
        stack.enter_context(t.daemon_up(out, ckpt, rank, args, device))
        while True:
            time.sleep(1)


def engine(ckpt: Path, out: Path, rank: int, device: str, sockets: Path) -> dict:
    """This process: SGLang's ``IpcModelLoader`` maps the daemon's rank; compared with SGLang's own loading."""
    import test_sglang_weight_cache as t
    from test_sglang_model_classes import reference

    with ExitStack() as stack:
        environment(stack, sockets, device)
        stack.enter_context(h.patched(rank, EP_SIZE, REDUNDANT))
        deadline = time.monotonic() + 600
        while not any(sockets.glob("*.ready")):
            if time.monotonic() > deadline:
                raise TimeoutError("the daemon never became ready")
            time.sleep(0.5)
        daemon = type("Daemon", (), {"socket_path": str(next(sockets.glob("*.sock")))})()
        t.plugins()
        tic = time.perf_counter()
        model = t.engine_restart(out, ckpt, rank, daemon, device)
        seconds = time.perf_counter() - tic
        want, differ, where = reference(ckpt, rank), [], set()
        for prefix, module in h.experts_of(model).items():
            for name, tensor in h.state(module).items():
                where.add(str(tensor.device))
                if not torch.equal(tensor.cpu(), h.state(want[prefix])[name].cpu()):
                    differ.append(f"{prefix}.{name}")
        return {"device": device, "mapped_on": sorted(where), "layers": len(h.experts_of(model)),
                "byte_exact": not differ, "differ": differ, "map_seconds": round(seconds, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=3)
    a = parser.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    ckpt, out = build(a.work)
    sockets = Path(tempfile.mkdtemp(prefix="swc", dir="/tmp"))
    daemon = multiprocessing.get_context("spawn").Process(target=daemon_main,
                                                          args=(ckpt, out, a.rank, a.device, sockets))
    daemon.start()
    try:
        result = engine(ckpt, out, a.rank, a.device, sockets)
    finally:
        daemon.terminate()
        daemon.join(30)
        for path in sockets.iterdir():
            path.unlink()
        sockets.rmdir()
    result.update(daemon_pid=daemon.pid, engine_pid=os.getpid())
    print(json.dumps(result))
    return 0 if result["byte_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
