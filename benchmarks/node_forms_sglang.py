"""SGLang 0.5.23's rank process for ``bench_node.py --engine sglang``: each form's preparation before
the node's ranks are released, the one load it times after, and the weight-cache daemon an
``ipc_cache`` restart maps.

Every rank builds SGLang's real model class of the family (``tests/engines/sglang_fp8_harness.py``:
``Qwen3MoeForCausalLM`` or ``DeepseekV3ForCausalLM`` holding real ``FusedMoE`` experts, FP8 128x128
blocks) on its GPU, under SGLang's own topology for ``--moe-a2a-backend megamoe`` on Hopper (the
SM90 platform check patched, nothing else); the quant method's post-processing is SGLang's own
``build_sm90_mega_moe_experts_weights``. SGLang's modules are imported as on a machine without CUDA
(``torch.cuda.is_available`` answers no while they import, and for them after: no compiled kernel
package is imported); their tensors live on the GPU. The forms:

  auto              SGLang's ``DefaultModelLoader`` (``--load-format auto``): its multi-threaded
                    safetensors iterator over the source, the model's ``load_weights``, every quant
                    method's post-processing;
  presharded_dump   ``--load-format presharded``'s first run: ``PreshardedModelLoader`` finds no dump,
                    loads as ``auto`` does and writes the post-processed tensors (its dump of the rank);
  presharded        its reload from that dump (the model built, post-processed empty, then filled);
  ipc_cache         an engine restart: SGLang's ``IpcModelLoader`` mapping the experts one weight-cache
                    daemon per rank holds (SGLang's ``WeightCacheDaemon`` export and serve loop, loaded
                    by its ``DefaultModelLoader`` from the source);
  ipc_cache_megamoe the same from daemons that installed the per-rank form (``megamoe preload``'s
                    daemons), mapped with megamoe-convert's hooks registered (``--weight-cache-mode
                    client`` on a conversion: the MegaMoE state rebuilt on the mapped tensors);
  megamoe_per_rank, megamoe_store
                    ``megamoe_convert.engines.sglang.install`` from the per-rank form / the store.

The benchmark's rank processes are not one process group: each ``presharded`` rank dumps into its own
folder as a world of one (``presharded_path``), which for the experts (no tensor of them is shared
between ranks) is the bytes a node's ranks write together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable
from unittest import mock

#: form -> which files it reads: the ``source`` checkpoint, its ``presharded`` dump, the ``ranks`` files, the
#: ``store``, or none (a restart maps the daemons' memory)
FORMS = {"auto": "source", "presharded_dump": "source", "presharded": "presharded", "ipc_cache": None,
         "ipc_cache_megamoe": None, "megamoe_per_rank": "ranks", "megamoe_store": "store"}
#: restart form -> (its daemon's load form, the path its ``ModelConfig`` names)
DAEMONS = {"ipc_cache": ("auto", "src"), "ipc_cache_megamoe": ("megamoe_per_rank", "per_rank")}
#: The forms a round times first (the ceilings right after them); every one of them here.
FIRST = tuple(FORMS)
#: family -> the preset of its published dims, the tiny one, its config key of the routed-expert count
FAMILIES = {"qwen3_moe": ("qwen3-moe", "qwen3-moe-tiny", "num_experts"),
            "deepseek_v3": ("deepseek-v3", "deepseek-v3-tiny", "n_routed_experts")}


def socket_path(shape: Any, rank: int, restart: str) -> str:
    """The daemon's socket in the rank's socket folder, one per restart form."""
    return str(Path(shape.socket_dir(rank)) / f"{restart}.sock")


def checkpoint_config(preset: str, family: str, layers: int, experts: int) -> dict[str, Any]:
    """The preset's config (real expert dims) cut to ``layers`` MoE layers of ``experts`` experts: no dense
    layers, no MTP layer, a small vocabulary."""
    from megamoe_convert.synth.presets import load_preset

    config = dict(load_preset(preset))
    config.update(num_hidden_layers=layers, vocab_size=1024, num_experts_per_tok=min(8, experts))
    config[FAMILIES[family][2]] = experts
    if family == "deepseek_v3":
        config.update(first_k_dense_replace=0, num_nextn_predict_layers=0,
                      n_group=min(config["n_group"], experts), topk_group=min(config["topk_group"], experts))
    return config


def expert_count(preset: str) -> int:
    """A preset's routed experts (``n_routed_experts`` or ``num_experts``)."""
    from megamoe_convert.synth.presets import load_preset

    config = load_preset(preset)
    return int(config.get("n_routed_experts") or config["num_experts"])


def presharded_dir(shape: Any, rank: int) -> Path:
    return shape.per_rank.parent / "presharded" / shape.name / f"rank{rank}"


def files_of(shape: Any, kind: str) -> list[Path]:
    """The files an SGLang form reads (the page cache is filled with them for a warm row)."""
    group = FORMS.get(kind, "ranks")
    if group == "source":
        return sorted(shape.src.glob("*.safetensors"))
    if group == "store":
        return sorted(shape.store.rglob("*.safetensors"))
    if group == "presharded":
        return sorted(f for r in range(shape.n) for f in presharded_dir(shape, r).rglob("*") if f.is_file())
    return [] if group is None else shape.node_files()


# --------------------------------------------------------------------------------------
# SGLang on the GPU, imported as without CUDA
# --------------------------------------------------------------------------------------

def gpu() -> bool:
    """Whether this process has a GPU."""
    import torch

    return torch.cuda.device_count() > 0


#: SGLang's modules the forms use, imported with the harness (so all of them see no CUDA while they import).
SGLANG_MODULES = ("sglang.srt.configs.load_config", "sglang.srt.configs.model_config",
                  "sglang.srt.configs.device_config", "sglang.srt.model_loader.loader",
                  "sglang.srt.weight_cache.ipc_loader", "sglang.srt.weight_cache.daemon",
                  "sglang.srt.weight_cache.protocol")


def import_sglang() -> types.ModuleType:
    """The harness and SGLang's modules, imported while ``torch.cuda.is_available`` answers no: SGLang then
    imports none of its compiled kernels (``sgl_kernel``, absent from the CPU build it stands on), settles on
    its CPU platform and caches its CUDA checks as false, as on the CPU machine its tests run on; after
    that, CUDA is there again for the tensors, the staging and the ceilings."""
    import torch

    if "sglang_fp8_harness" in sys.modules:
        return sys.modules["sglang_fp8_harness"]
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    try:
        importlib.import_module("sglang_harness")  # the torchvision stand-in, before SGLang is imported
        harness = importlib.import_module("sglang_fp8_harness")
        for name in SGLANG_MODULES:
            importlib.import_module(name)
        from sglang.srt import platforms
        from sglang.srt.utils.common import is_cuda, is_cuda_alike

        assert platforms.current_platform is not None  # resolved once, here
        is_cuda(), is_cuda_alike()  # cached
    finally:
        torch.cuda.is_available = real
    return harness


def device() -> Any:
    import torch

    return torch.device("cuda", 0) if gpu() else torch.device("cpu")


def sync() -> None:
    import torch

    if gpu():
        torch.cuda.synchronize()


def family_of(shape: Any) -> str:
    return json.loads((shape.src / "config.json").read_text())["model_type"]


def build_tree(f: types.ModuleType, shape: Any, rank: int) -> Any:
    """SGLang's model class with the rank's MegaMoE experts, on the current default device; its
    ``load_weights`` takes the routed experts of what the loader reads (the tree holds nothing else)."""
    import torch

    family, config = family_of(shape), f.hf_config(shape.src)
    with torch.device("cpu"):  # the expert-location table first, off ``meta``, as the engine builds it
        f.set_expert_location(family, config, rank)
    with mock.patch.object(f, "set_expert_location", lambda *_: None):
        model = f.build_main_model(family, config, rank, 0)
    real = model.load_weights
    model.load_weights = lambda weights: real((n, t) for n, t in weights if ".mlp.experts." in n)
    return model


@contextlib.contextmanager
def constructor(f: types.ModuleType, shape: Any, rank: int, model: Any):
    """SGLang's model constructor (``_initialize_model``) building the tree: ``model`` on the target device,
    a fresh one on ``meta`` (or wherever there is no ``model``)."""
    import torch
    from sglang.srt.model_loader import loader as loader_py
    from sglang.srt.weight_cache import ipc_loader

    def initialize(model_config: Any, load_config: Any, quant_config: Any = None) -> Any:
        if torch.get_default_device().type == "meta" or model is None:
            return build_tree(f, shape, rank)
        return model

    with mock.patch.object(loader_py, "_initialize_model", initialize), \
            mock.patch.object(ipc_loader, "_initialize_model", initialize):
        yield


@dataclasses.dataclass
class Prepared:
    load: Callable[[], Any]
    model: Any = None
    #: SGLang's ``ModelConfig`` of the source.
    config: Any = None
    #: Run after the release, before the clock starts (``presharded_dump``: the last dump removed).
    reset: Callable[[], None] = lambda: None


def device_config() -> Any:
    from sglang.srt.configs.device_config import DeviceConfig

    return DeviceConfig("cuda" if gpu() else "cpu", 0)


def prepare(kind: str, rank: int, shape: Any, stack: contextlib.ExitStack) -> Prepared:
    """What the form's loader holds when the engine has made it and built the model."""
    import torch

    f = import_sglang()
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig

    dev = device()
    stack.enter_context(f.patched(rank, shape.ep_size, 0))  # SGLang's topology for the rank (SM90, TP = EP)
    with torch.device(dev):
        model = build_tree(f, shape, rank) if kind not in DAEMONS else None
    stack.enter_context(constructor(f, shape, rank, model))
    if kind == "ipc_cache_megamoe":  # SGLang's plugins, megamoe-convert's among them, as its processes load them
        from megamoe_convert.engines.sglang.preload import prepare_daemon

        prepare_daemon()
    model_config = ModelConfig(model_path=str(getattr(shape, DAEMONS.get(kind, ("", "src"))[1])))
    if kind == "auto":
        from sglang.srt.model_loader.loader import DefaultModelLoader

        loader = DefaultModelLoader(LoadConfig(load_format="auto"))
        return Prepared(lambda: loader.load_weights_and_postprocess(
            model, loader._get_all_weights(model_config, model), dev), model, model_config)
    if kind in ("megamoe_per_rank", "megamoe_store"):
        from megamoe_convert.engines.sglang import install

        out = shape.store if kind == "megamoe_store" else shape.per_rank
        if gpu():
            from megamoe_convert.serve.staging import prepare_gpu_staging

            prepare_gpu_staging(out)
        return Prepared(lambda: install(model, str(out), rank=rank), model, model_config)
    prepared = Prepared(lambda: None, config=model_config)
    if kind in ("presharded_dump", "presharded"):
        from sglang.srt.model_loader.loader import PreshardedModelLoader

        folder = presharded_dir(shape, rank)
        loader = PreshardedModelLoader(LoadConfig(load_format="presharded",
                                                  model_loader_extra_config={"presharded_path": str(folder)}))

        def load() -> None:
            if kind == "presharded" and not any(folder.glob("*/READY")):
                raise RuntimeError(f"{folder}: no presharded dump (its first run did not run)")
            prepared.model = loader.load_model(model_config=model_config, device_config=device_config())

        if kind == "presharded_dump":
            prepared.reset = lambda: shutil.rmtree(folder, ignore_errors=True)
        prepared.load = load
        return prepared
    from sglang.srt.weight_cache.ipc_loader import IpcModelLoader

    share_on_cpu()
    loader = IpcModelLoader(LoadConfig(load_format="ipc_cache"), socket_path=socket_path(shape, rank, kind),
                            weight_cache_mode="daemon")
    prepared.load = lambda: setattr(prepared, "model", loader.load_model(model_config=model_config,
                                                                       device_config=device_config()))
    return prepared


# --------------------------------------------------------------------------------------
# What the kernel reads
# --------------------------------------------------------------------------------------

#: The parameters ``build_sm90_mega_moe_experts_weights`` leaves for the kernel (its ``mega_l1_weights`` /
#: ``mega_l2_weights`` tuples alias them).
KERNEL = ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")


def kernel_report(model: Any) -> dict[str, Any]:
    """A checksum of the bytes the kernel reads, module by module, and whether each module holds the
    MegaMoE tuples the SM90 forward passes the kernel (aliasing those parameters)."""
    from bench_startup import fingerprint

    experts = sorted(((m.layer_name, m) for m in model.modules() if hasattr(m, "moe_ep_rank")), key=lambda x: x[0])
    tensors = [getattr(m, name).data for _, m in experts for name in KERNEL]

    def tuples(m: Any) -> bool:
        pairs = getattr(m, "mega_l1_weights", None), getattr(m, "mega_l2_weights", None)
        return all(p is not None for p in pairs) and \
            pairs[0][0].data_ptr() == m.w13_weight.data_ptr() and pairs[1][0].data_ptr() == m.w2_weight.data_ptr()

    return {"fingerprint": fingerprint(tensors), "kernel_tuples": all(tuples(m) for _, m in experts),
            "modules": len(experts)}


# --------------------------------------------------------------------------------------
# The rank process, and the daemon
# --------------------------------------------------------------------------------------

def child_main(kind: str, rank: int, shape: Any, fingerprint: bool, start: float) -> None:
    """A rank process: ``ready`` on its protocol pipe once prepared, then one report after ``go``. The
    ceilings are the vLLM benchmark's own processes (they import no engine)."""
    if kind not in FORMS:
        from node_forms import child_main as ceiling_main

        ceiling_main(kind, rank, shape, fingerprint, start)
        return
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # SGLang's logger and every print: to the log, never into the protocol
    from bench_startup import io_read_bytes

    with contextlib.ExitStack() as stack:
        prepared = prepare(kind, rank, shape, stack)
        imported = time.perf_counter() - start
        sync()
        ready_unix = time.time()
        protocol.write("ready\n")
        if sys.stdin.readline().strip() != "go":
            return
        prepared.reset()
        read_before, t0, start_unix = io_read_bytes(), time.perf_counter(), time.time()
        prepared.load()
        sync()
        seconds, end_unix = time.perf_counter() - t0, time.time()
        report = {"rank": rank, "seconds": seconds, "start_unix": start_unix, "end_unix": end_unix,
                  "read_bytes": io_read_bytes() - read_before, "import_s": imported, "ready_s": t0 - start,
                  "ready_unix": ready_unix}
        if kind == "presharded_dump":  # what the rank's dump holds on disk
            dump = presharded_dir(shape, rank).rglob("*")
            report["written_bytes"] = sum(f.stat().st_size for f in dump if f.is_file())
        if fingerprint and prepared.model is not None:
            report.update(kernel_report(prepared.model))
        protocol.write(json.dumps(report) + "\n")


def share_on_cpu() -> None:
    """Without a GPU the daemon's tensors travel through shared-memory files (torch's ``file_system``
    strategy: its default passes descriptors only to processes of one parent); on a GPU, CUDA IPC."""
    import torch.multiprocessing

    if not gpu():
        torch.multiprocessing.set_sharing_strategy("file_system")


def cache_config(model_config: Any) -> Any:
    """The ``CacheConfig`` SGLang's daemon states for this rank: the fields its engine side compares
    (``IpcModelLoader._fetch_from_cache``), from the same topology and model config."""
    from sglang.srt.runtime_context import get_exec, get_parallel
    from sglang.srt.weight_cache import protocol as p

    parallel = get_parallel()
    quant = getattr(model_config.hf_config, "quantization_config", None)
    method = p.get_quant_method_name(model_config.quantization) or p.get_quant_method_name(quant)
    p.check_ipc_quant_support(method, quant, where="daemon")
    return p.CacheConfig(
        model_path=model_config.model_path, model_arch=(model_config.hf_config.architectures or [""])[0],
        tp_size=parallel.tp_size, tp_rank=parallel.tp_rank, pp_size=parallel.pp_size, pp_rank=parallel.pp_rank,
        dp_size=parallel.dp_size, ep_size=parallel.moe_ep_size, moe_dp_size=parallel.moe_dp_size,
        moe_dp_rank=parallel.moe_dp_rank, moe_ep_rank=parallel.moe_ep_rank, attn_dp_size=parallel.attn_dp_size,
        enable_dp_lm_head=parallel.enable_dp_lm_head, attn_cp_size=parallel.attn_cp_size,
        moe_dense_tp_size=parallel.moe_dense_tp_size, moe_a2a_backend=get_exec().moe.moe_a2a_backend,
        quant_method=method, quant_config_hash=p.hash_quant_config(quant), dtype=str(model_config.dtype),
        revision=model_config.revision or "", **p.compute_env_stamp())


def daemon_main(restart: str, rank: int, shape: Any, start: float) -> None:
    """One SGLang weight-cache daemon for the ``restart`` form: the rank's experts loaded by SGLang's
    ``DefaultModelLoader`` from the source (``ipc_cache``) or installed from the per-rank form
    (``ipc_cache_megamoe``), exported by ``WeightCacheDaemon._export_state`` and served by its ``serve``
    loop on its socket; its report (one JSON line) once it has exported them, before it serves."""
    import torch

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    stack = contextlib.ExitStack()
    prepared = prepare(DAEMONS[restart][0], rank, shape, stack)
    share_on_cpu()
    torch.set_num_threads(1)  # as SGLang's daemon loads
    from sglang.srt.weight_cache.daemon import WeightCacheDaemon

    imported = time.perf_counter()
    daemon = WeightCacheDaemon.__new__(WeightCacheDaemon)
    daemon.gpu_id, daemon.model, daemon.state_entries, daemon.transport_backend = 0, prepared.model, {}, None
    daemon.socket_path = socket_path(shape, rank, restart)
    daemon.ready_path = daemon.socket_path + ".ready"
    before = torch.cuda.memory_reserved() if gpu() else 0
    prepared.load()
    sync()
    loaded = time.perf_counter()
    if restart == "ipc_cache_megamoe":  # megamoe preload's daemon: SGLang's plugins loaded, the conversion's config
        from sglang.srt.configs.model_config import ModelConfig

        from megamoe_convert.engines.sglang.preload import prepare_daemon

        prepare_daemon()
        prepared.config = ModelConfig(model_path=str(shape.per_rank))
    daemon.config = cache_config(prepared.config)
    daemon.preloaded_weights_bytes = max(0, (torch.cuda.memory_reserved() if gpu() else 0) - before)
    daemon._export_state()
    report = {"role": "daemon", "restart": restart, "import_s": imported - start, "load_s": loaded - imported,
              "ready_s": time.perf_counter() - start, **kernel_report(daemon.model)}
    protocol.write(json.dumps(report) + "\n")
    with stack:
        daemon.serve()  # until the parent ends it
