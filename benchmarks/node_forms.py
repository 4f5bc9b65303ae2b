"""The rank process of ``bench_node.py``: what each form prepares before the node's ranks are
released, and the one load it times after.

A rank process speaks to its parent on its own pipe (its original stdout): ``ready`` once its
modules are built and its loader made, then one JSON report after the ``go`` line on stdin.
Everything else the process (or vLLM's logger) prints goes to its log on stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable
from unittest import mock

#: form -> (how it loads, vLLM --load-format, vLLM's EP weight filter)
FORMS = {
    "auto": ("vllm", "auto", False),
    "auto_ep_filter": ("vllm", "auto", True),
    "fastsafetensors": ("vllm", "fastsafetensors", False),
    "instanttensor": ("vllm", "instanttensor", False),
    "runai_streamer": ("vllm", "runai_streamer", False),
    "megamoe_per_rank": ("install", "megamoe", False),
    "megamoe_store": ("install", "megamoe", False),
    "ipc_cache": ("ipc", "ipc_cache", False),
}
#: The ceilings' kinds: the node's disk (cold: one reader of the node's files, and every rank reading
#: its own at once), and page cache -> pinned -> device with every rank at once (warm: the path as
#: one pipeline, and its halves timed apart).
CEILINGS = ("disk_read", "disk_read_ranks", "pipe", "host_read", "h2d")
#: The Python packages vLLM's iterator for a load format imports.
FORMAT_PACKAGES = {"fastsafetensors": "fastsafetensors", "instanttensor": "instanttensor",
                   "runai_streamer": "runai_model_streamer"}


def files_read(kind: str) -> str | None:
    """Which files a form or ceiling reads: the ``source`` checkpoint (vLLM's loaders), the ``store``,
    the node's ``ranks`` files (the per-rank form and the ceilings), or none (an ``ipc_cache`` restart)."""
    if FORMS.get(kind, ("",))[0] == "vllm":
        return "source"
    return {"megamoe_store": "store", "ipc_cache": None}.get(kind, "ranks")


def rank_files(out: Path, rank: int) -> list[Path]:
    return sorted(out.glob(f"rank-{rank:05d}-of-*/*.safetensors"))


@dataclasses.dataclass(frozen=True)
class Shape:
    """One node's place in a deployment: ranks 0..n-1 of EP ``ep_size``, and the files they load."""

    name: str
    layers: int
    ep_size: int
    n: int
    src: Path
    per_rank: Path
    store: Path
    sockets: str
    #: Whose modules the ranks build and load into: ``vllm`` (this module) or ``sglang`` (node_forms_sglang).
    engine: str = "vllm"

    def to_json(self) -> str:
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> "Shape":
        d = json.loads(text)
        return cls(**{**d, "src": Path(d["src"]), "per_rank": Path(d["per_rank"]), "store": Path(d["store"])})

    def node_files(self) -> list[Path]:
        return [f for r in range(self.n) for f in rank_files(self.per_rank, r)]

    def file_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.node_files())

    def expert_bytes(self) -> int:
        """The routed experts' bytes the node's GPUs hold once loaded (the rank files also carry the
        fused shared expert, which these modules do not hold, and the logical ids)."""
        from megamoe_convert.source.safetensors_io import read_header

        return sum(t.nbytes for f in self.node_files() for name, t in read_header(f).tensors.items()
                   if ".shared_" not in name and not name.endswith("logical_ids"))

    def files_of(self, kind: str) -> list[Path]:
        """The files ``kind`` reads (the page cache is filled with them for a warm run)."""
        if self.engine == "sglang":
            from node_forms_sglang import files_of

            return files_of(self, kind)
        group = files_read(kind)
        if group == "source":
            return sorted(self.src.glob("*.safetensors"))
        if group == "store":
            return sorted(self.store.rglob("*.safetensors"))
        return [] if group is None else self.node_files()

    def socket_dir(self, rank: int) -> str:
        path = Path(self.sockets) / f"{self.name}-{rank}"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)


# --------------------------------------------------------------------------------------
# What each form prepares; the load it times
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Prepared:
    load: Callable[[], Any]
    model: Any = None


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def _cuda_platform():
    """vLLM's CPU platform stands in on the GPU machine (its trees there carry no compiled
    libraries): its load-format iterators ask the platform which GPU to load onto."""
    import torch
    import vllm.model_executor.model_loader.weight_utils as weight_utils

    real = weight_utils.current_platform

    class Cuda:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def is_cuda(self) -> bool:
            return True

        def is_cuda_alike(self) -> bool:
            return True

        def current_device(self) -> int:
            return torch.cuda.current_device()

    with mock.patch.object(weight_utils, "current_platform", Cuda()):
        yield


def skip_reason(kind: str) -> str | None:
    """Why ``kind`` cannot run on this machine (the parent asks before it starts any rank process), or ``None``."""
    import torch

    if kind in ("fastsafetensors", "instanttensor", "h2d", "pipe") and not torch.cuda.is_available():
        return "needs a CUDA GPU (it reads onto the device)"
    package = FORMAT_PACKAGES.get(kind)
    if package and importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    return None


def _tree(shape: Shape, rank: int, device: Any):
    from bench_daemon import tree

    return tree(types.SimpleNamespace(model=str(shape.src), rank=rank, ep_size=shape.ep_size), device)


def prepare_vllm(kind: str, rank: int, shape: Shape, stack: contextlib.ExitStack) -> Prepared:
    """vLLM's own loader for the form's ``--load-format``, as the engine makes it."""
    import torch
    import vllm_harness as h
    from bench_daemon import vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    _, load_format, ep_filter = FORMS[kind]
    stack.enter_context(h.patched(rank, shape.ep_size))
    config = vllm_config(str(shape.src), load_format=load_format)
    loader = get_model_loader(config.load_config)
    if ep_filter:  # what --enable-ep-weight-filter computes for this rank (EP = DP here)
        from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids

        loader.local_expert_ids = compute_local_expert_ids(h.hf_config(shape.src).n_routed_experts,
                                                           shape.ep_size, rank)
    model = _tree(shape, rank, _device())
    stack.enter_context(set_current_vllm_config(config))
    if torch.cuda.is_available():
        stack.enter_context(_cuda_platform())
    return Prepared(lambda: loader.load_weights(model, config.model_config), model)


def prepare_install(kind: str, rank: int, shape: Shape, stack: contextlib.ExitStack) -> Prepared:
    """``install`` from the per-rank form or the store, with what vLLM's model class starts while it
    builds the model: the pinned staging, the install's imports and layout-probe input, and the probe
    on the first MoE block built (``prepare_install``; its imports done before the tree is built and the
    probe before the rank is ready, as a real model build of seconds lets them be: the tree here holds
    only the MoE layers)."""
    import torch
    import vllm_harness as h

    from megamoe_convert.engines import early_probe
    from megamoe_convert.engines.load_formats import prepare_install as prepare_ahead
    from megamoe_convert.engines.vllm import install

    out = shape.store if kind == "megamoe_store" else shape.per_rank
    if torch.cuda.is_available():
        from megamoe_convert.serve.staging import prepare_gpu_staging

        prepare_gpu_staging(out)
    stack.enter_context(h.patched(rank, shape.ep_size))
    prepare_ahead(str(out), "megamoe_convert.engines.vllm.installing").join()
    model = _tree(shape, rank, _device())
    if (probing := early_probe.started()) is not None:
        probing.result()
    early_probe.stop()
    return Prepared(lambda: install(model, str(out), rank=rank), model)


def prepare_ipc(kind: str, rank: int, shape: Shape, stack: contextlib.ExitStack) -> Prepared:
    """An engine restart: vLLM's ``IpcModelLoader`` (megamoe-convert's registration) mapping the
    experts the rank's daemon holds; the model built on ``meta`` as vLLM builds it there."""
    import vllm_harness as h
    from bench_daemon import vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    from megamoe_convert.engines.vllm.plugin import register

    load_general_plugins()
    register()  # the entry point's own call, for a checkout run without `pip install`
    from vllm.model_executor.model_loader.weight_cache import ipc_loader

    stack.enter_context(h.weight_cache_patched(rank, shape.ep_size))
    config = vllm_config(str(shape.per_rank), load_format="ipc_cache",
                         model_loader_extra_config={"socket_dir": shape.socket_dir(rank), "fallback": False})
    loader = get_model_loader(config.load_config)
    stack.enter_context(set_current_vllm_config(config))
    build = lambda vllm_config, model_config, prefix="": _tree(shape, rank, None)  # noqa: E731
    stack.enter_context(mock.patch.object(ipc_loader, "initialize_model", build))
    prepared = Prepared(lambda: None)
    prepared.load = lambda: setattr(prepared, "model", loader.load_model(config, config.model_config))
    return prepared


def prepare_ceiling(kind: str, rank: int, shape: Shape, stack: contextlib.ExitStack) -> Prepared:
    import torch
    from bench_load import HostRead

    if kind == "disk_read":  # the node's files, one reader of 64 threads x 4 MB
        return Prepared(HostRead(shape.node_files(), 64, 4 << 20).run)
    if kind == "disk_read_ranks":  # this rank's files, every rank at once, 32 threads x 4 MB
        return Prepared(HostRead(rank_files(shape.per_rank, rank), 32, 4 << 20).run)
    if kind == "pipe":  # this rank's files to its GPU through pinned buffers, the loader's threads and pieces
        from bench_load import PipeCopy

        pipe = PipeCopy(rank_files(shape.per_rank, rank), 16, 16 << 20, _device())
        return Prepared(pipe.run)
    if kind == "host_read":  # this rank's files, the loader's threads and pieces
        return Prepared(HostRead(rank_files(shape.per_rank, rank), 16, 16 << 20).run)
    nbytes = sum(f.stat().st_size for f in rank_files(shape.per_rank, rank))
    pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dest = torch.empty(nbytes, dtype=torch.uint8, device=_device())
    return Prepared(lambda: dest.copy_(pinned, non_blocking=True))


PREPARE = {"vllm": prepare_vllm, "install": prepare_install, "ipc": prepare_ipc}


def child_main(kind: str, rank: int, shape: Shape, fingerprint: bool, start: float) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's logger and every print: to the log, never into the protocol
    import torch
    from bench_startup import io_read_bytes

    imported = time.perf_counter() - start
    with contextlib.ExitStack() as stack:
        prepare = PREPARE[FORMS[kind][0]] if kind in FORMS else prepare_ceiling
        prepared = prepare(kind, rank, shape, stack)
        probe = None
        if FORMS.get(kind, ("",))[0] == "install":  # the layout probe's time and the load's wait for it
            from probe_timer import ProbeTimer

            probe = ProbeTimer()
            stack.enter_context(probe.timing())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ready_unix = time.time()
        protocol.write("ready\n")
        if sys.stdin.readline().strip() != "go":
            return
        read_before, t0, start_unix = io_read_bytes(), time.perf_counter(), time.time()
        prepared.load()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds, end_unix = time.perf_counter() - t0, time.time()
        report = {"rank": rank, "seconds": seconds, "start_unix": start_unix, "end_unix": end_unix,
                  "read_bytes": io_read_bytes() - read_before, "import_s": imported,
                  "ready_s": t0 - start, "ready_unix": ready_unix, **(probe.report() if probe else {})}
        if fingerprint and prepared.model is not None:
            from bench_daemon import kernel_fingerprint

            report["fingerprint"] = kernel_fingerprint(prepared.model)
        protocol.write(json.dumps(report) + "\n")
