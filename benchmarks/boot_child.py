"""The rank process of ``bench_boot.py``: one rank's start, from the interpreter to a loaded model,
every phase timed, and the source checkpoint it reads, written from the model vLLM builds.

The model is vLLM 0.33's own ``DeepseekV4ForCausalLM`` (``vllm.models.deepseek_v4.nvidia``): every
decoder layer's real attention, MoE block with its ``DeepGemmMegaMoEExperts``, norms, embedding and
head, built by its own ``__init__`` from the config ``EngineArgs`` makes (with ``--load-format
megamoe``, through the plugin's subclass of it, the class vLLM's registry gives once the plugin is
registered); its weights go through vLLM's ``DefaultModelLoader`` (``--load-format auto``) or
megamoe-convert's loader (``--load-format megamoe``), then vLLM's ``process_weights_after_loading``.
The plugin's own costs are reported apart: its import and ``register``, what its loader's first
call imports, the layout probe and how long the load waited for it. Patched, as the test
harnesses patch: the SM100 checks (the device capability reads as SM100, the MegaMoE support check),
the process groups (a world of one process, the EP group's rank and size set), and, on a machine
without CUDA, the CUDA streams and events the constructors make.

The process speaks one JSON line on its original stdout (its report); everything else goes to stderr.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

from probe_timer import ProbeTimer

#: vLLM's stacked parameters: fused name -> the checkpoint's names, in shard order.
STACKED = {"gate_up_proj": ("w1", "w3"), "attn.fused_wqa_wkv": ("attn.wq_a", "attn.wkv"),
           "compressor.fused_wkv_wgate": ("compressor.wkv", "compressor.wgate")}
#: vLLM names -> checkpoint names (the inverse of ``_make_deepseek_v4_weights_mapper``'s).
RENAMES = (("model.embed_tokens.weight", "embed.weight"), ("lm_head.weight", "head.weight"),
           (".ffn.gate.e_score_correction_bias", ".ffn.gate.bias"), (".shared_experts.down_proj", ".shared_experts.w2"),
           (".weight_scale_inv", ".scale"))
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32", "int32": "I32", "int64": "I64", "float16": "F16",
                      "uint8": "U8", "int8": "I8", "float8_e4m3fn": "F8_E4M3", "float8_e8m0fnu": "F8_E8M0"}


# --------------------------------------------------------------------------------------
# vLLM's config and model, patched as the harnesses patch
# --------------------------------------------------------------------------------------

def engine_config(model: str, load_format: str) -> Any:
    """The config ``vllm serve MODEL --load-format F --moe-backend deep_gemm_mega_moe
    --enable-expert-parallel --enforce-eager`` makes."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, load_format=load_format, moe_backend="deep_gemm_mega_moe",
                      enable_expert_parallel=True, enforce_eager=True, max_model_len=4096).create_engine_config()


def process_group(config: Any, port: int) -> None:
    """vLLM's groups over a world of this one process (gloo): TP = PP = DP = 1."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)


@contextlib.contextmanager
def patched(rank: int, ep_size: int) -> Iterator[Any]:
    """The harness's patches (EP rank and size, the MegaMoE SM100 check), the device capability read
    as SM100 (the attention picks its SM100 recipe), and without CUDA its streams and events."""
    import torch
    import vllm_harness as h
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    model_py = importlib.import_module("vllm.models.deepseek_v4.nvidia.model")
    ep_group = type("EP", (), {"rank_in_group": rank, "world_size": ep_size})()
    sm100 = classmethod(lambda cls, device_id=0: DeviceCapability(10, 0))
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(h.patched(rank, ep_size))
        enter(mock.patch.object(model_py, "get_ep_group", lambda: ep_group))
        enter(mock.patch.object(type(current_platform), "get_device_capability", sm100))
        if torch.cuda.is_available():  # vLLM's CPU platform (no vllm._C here) would pack its linears for the CPU
            enter(mock.patch("vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm", _plain_linear))
        else:
            enter(mock.patch("torch.cuda.Stream", lambda *a, **k: None))
            enter(mock.patch("torch.cuda.Event", lambda *a, **k: None))
            enter(mock.patch("torch.accelerator.current_device_index", lambda: 0))
            enter(mock.patch("torch.accelerator.empty_cache", lambda: None))
        yield model_py


def _plain_linear(layer: Any, remove_weight: bool) -> None:
    """What vLLM's CPU platform does for a layer it skips packing: the plain ``F.linear`` on the weight."""
    import torch

    layer.cpu_linear = torch.nn.functional.linear


def model_class(model_py: Any, form: str) -> Any:
    """The class vLLM's registry gives: its own ``DeepseekV4ForCausalLM``, or with the plugin
    registered (``megamoe``) the plugin's subclass of it (its checks and its staging start run
    while the model is built, as in ``vllm serve``)."""
    if form != "megamoe":
        return model_py.DeepseekV4ForCausalLM
    from megamoe_convert.engines.vllm import model_classes

    return model_classes.make_model_class(model_py.DeepseekV4ForCausalLM, draft=False)


def build(cls: Any, config: Any, device: Any) -> Any:
    """``cls(vllm_config=...)`` as ``initialize_model`` calls it: under the model's dtype, on
    ``device``, with the config current."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), torch.device(device):
        return cls(vllm_config=config, prefix="")


# --------------------------------------------------------------------------------------
# The source checkpoint: every tensor the model loads, named as the checkpoint names it
# --------------------------------------------------------------------------------------

def checkpoint_names(model: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """(checkpoint name, safetensors dtype, shape) of every non-expert tensor ``model.load_weights``
    takes: its parameters outside the routed experts, stacked ones split into their shards."""
    modules = dict(model.named_modules())
    out = []
    for name, param in model.named_parameters():
        if ".ffn.experts." in name:
            continue
        dtype, shape = SAFETENSORS_DTYPES[str(param.dtype).removeprefix("torch.")], tuple(param.shape)
        for old, new in RENAMES:
            name = name.replace(old, new)
        name = name.removeprefix("model.")
        for fused, parts in STACKED.items():
            if f"{fused}." in name:
                sizes = modules[_owner(modules, name)].output_sizes
                out += [(name.replace(fused, part), dtype, (size, *shape[1:]))
                        for part, size in zip(parts, sizes, strict=True)]
                break
        else:
            out.append((name, dtype, shape))
    return out


def _owner(modules: dict[str, Any], ckpt_name: str) -> str:
    """The module name (vLLM's) holding a stacked parameter named ``ckpt_name`` (checkpoint-side)."""
    head = ckpt_name.rpartition(".")[0]
    return head if head in modules else f"model.{head}"


def write_source(out: Path, rank: int, ep_size: int, ranks: int) -> dict[str, Any]:
    """``out``'s non-expert tensors (one file), and each layer's routed experts that ranks
    ``0..ranks-1`` of EP ``ep_size`` hold (one file a layer); the other ranks' experts, where there are
    any, as sparse files (listed, so the checkpoint is whole, but no byte of them on the disk)."""
    import numpy as np

    from megamoe_convert.output.writer import write_json_atomic, write_safetensors
    from megamoe_convert.source import families, formats
    from megamoe_convert.source.layers import MoELayer
    from megamoe_convert.source.safetensors_io import encode_header
    from megamoe_convert.synth.tensors import SynthTensor, expert_tensors

    raw = json.loads((out / "config.json").read_text())
    config = engine_config(str(out), "dummy")
    process_group(config, 29400)
    with patched(rank, ep_size) as model_py:
        rest = checkpoint_names(build(model_py.DeepseekV4ForCausalLM, config, "meta"))
    rng = np.random.default_rng(0)
    weight_map: dict[str, str] = {}

    def write(name: str, tensors: list[SynthTensor]) -> None:
        chunks = (tensor_bytes(t, rng) for t in tensors)
        write_safetensors(out / name, out, [t.spec() for t in tensors], chunks, metadata={"format": "pt"}, fsync=False)
        weight_map.update({t.name: name for t in tensors})

    def write_unread(name: str, tensors: list[SynthTensor]) -> None:
        """A file whose header lists ``tensors`` and whose data is a hole (a sparse file): the
        checkpoint is whole for ``convert``, and no rank of the node reads these bytes."""
        header = encode_header([t.spec() for t in tensors], {"format": "pt"})
        with open(out / name, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(t.spec().nbytes for t in tensors))
        weight_map.update({t.name: name for t in tensors})

    fills = {"BF16": "bf16", "F32": "bf16", "F16": "bf16"}  # finite floats, each tensor its own; integers random
    write("rest.safetensors", [SynthTensor(n, d, s, fills.get(d, "random")) for n, d, s in rest])
    per_rank = raw["n_routed_experts"] // ep_size
    names = families.detect(raw, "config.json").names(raw["num_hidden_layers"])
    for i in range(raw["num_hidden_layers"]):
        experts = [t for t in expert_tensors(names, MoELayer(False, i), per_rank * ranks, raw["hidden_size"],
                                             raw["moe_intermediate_size"], formats.MXFP4, "I8", "F8_E8M0")]
        write(f"experts-{i:03d}.safetensors", experts)
        if per_rank * ranks < raw["n_routed_experts"]:  # the other ranks' experts: listed, never read here
            held = {t.name for t in experts}
            write_unread(f"experts-{i:03d}-other-ranks.safetensors", [
                t for t in expert_tensors(names, MoELayer(False, i), raw["n_routed_experts"], raw["hidden_size"],
                                          raw["moe_intermediate_size"], formats.MXFP4, "I8", "F8_E8M0")
                if t.name not in held])
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    write_json_atomic(out / "model.safetensors.index.json", json.dumps(index), fsync=False)
    return {"rest_tensors": len(rest), "rest_bytes": (out / "rest.safetensors").stat().st_size}


def tensor_bytes(t: Any, rng: Any) -> Any:
    """``t``'s bytes, fast: ``ones`` as 1.0 (any float width: finite), ``bf16`` as random finite floats
    of its width (random bits, the exponent's top bit cleared: magnitudes below 2, every tensor's
    bytes its own, so a tensor loaded into another's place shows), ``scale`` as UE8M0 bytes in synth's
    range, anything else SFC64 raw words."""
    import numpy as np

    from megamoe_convert.synth.tensors import SCALE_BYTE_RANGE

    if t.fill == "ones":
        return np.full(t.nbytes // 2, 0x3F80, dtype=np.uint16).tobytes()
    raw = np.random.Generator(np.random.SFC64(int(rng.integers(2**62)))).bit_generator.random_raw(-(-t.nbytes // 8))
    raw = raw.view(np.uint8)[:t.nbytes]
    if t.fill == "bf16":
        words = raw.view({"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}[t.dtype])
        words &= ~np.array(1 << (8 * words.itemsize - 2), dtype=words.dtype)  # the exponent's top bit
    if t.fill == "scale":
        lo, hi = SCALE_BYTE_RANGE
        raw = (raw % (hi - lo) + lo).astype(np.uint8)
    return memoryview(raw)


# --------------------------------------------------------------------------------------
# One rank's start
# --------------------------------------------------------------------------------------

class Split:
    """The weight phase's time split between the routed experts and everything else: each tensor's
    read (the iterator's ``next``) and its load (the model's work until it asks again) go to its kind."""

    def __init__(self, experts: str = ".ffn.experts.") -> None:
        self.experts = experts  # what a routed expert's checkpoint name holds
        self.seconds = {"experts": 0.0, "rest": 0.0}
        self.tensors = {"experts": 0, "rest": 0}

    def wrap(self, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        it = iter(weights)
        while True:
            t0 = time.perf_counter()
            try:
                name, tensor = next(it)
            except StopIteration:
                return
            kind = "experts" if self.experts in name else "rest"
            self.tensors[kind] += 1
            yield name, tensor
            self.seconds[kind] += time.perf_counter() - t0


def rank_main(form: str, rank: int, ep_size: int, model: str, port: int, start: float, spawned: float) -> dict:
    """One rank's start (``form``: ``auto`` or ``megamoe``); the report of its phases."""
    marks: dict[str, float] = {"python": start}
    import torch
    import vllm_harness  # noqa: F401  (vLLM's modules the model and the loader import)
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    importlib.import_module("vllm.models.deepseek_v4.nvidia.model")
    marks["imports"] = time.perf_counter()
    fixed: dict[str, float] = {}
    if form == "megamoe":  # vLLM's load_general_plugins runs the entry point: its import, then register()
        t0 = time.perf_counter()
        from megamoe_convert.engines.vllm import plugin
        fixed["plugin_import_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        plugin.register()
        fixed["plugin_register_s"] = time.perf_counter() - t0
    marks["plugin"] = time.perf_counter()
    device = cuda_device(torch.cuda.is_available())
    marks["cuda"] = time.perf_counter()
    config = engine_config(model, form)
    marks["config"] = time.perf_counter()
    process_group(config, port)
    marks["process_group"] = time.perf_counter()
    split, probe = Split(), ProbeTimer()
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config), patched(rank, ep_size) as model_py, _cuda_platform(device):
        loader = get_model_loader(config.load_config)  # megamoe's starts its staging here
        loader.enable_weights_track = False  # as for a quantized (FP8) checkpoint: no strict tracking
        marks["loader"] = time.perf_counter()
        with probe.while_building() if form == "megamoe" else contextlib.nullcontext():
            net = build(model_class(model_py, form), config, device)
        _sync(device)
        marks["construct"] = time.perf_counter()
        experts_s = _load(loader, net, config, split, form, probe, fixed)
        _sync(device)
        marks["weights"] = time.perf_counter()
        process_weights_after_loading(net, config.model_config, device)
        _sync(device)
        marks["post"] = time.perf_counter()
    phases = _phases(marks)
    weights_s = phases["weights"]
    experts = experts_s if form == "megamoe" else split.seconds["experts"]
    report = {"form": form, "rank": rank, "phases": phases, "process_s": marks["post"] - start,
              "spawned_unix": spawned, "end_unix": time.time(),
              "weights_experts_s": experts, "weights_rest_s": weights_s - experts,
              "tensors": split.tensors, **fixed, **probe.report(), **_ring_report(marks),
              "parameters": sum(p.numel() for p in net.parameters()),
              "gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None}
    report["rest_staged"] = "megamoe_convert.serve.tensor_stream" in sys.modules  # the rest through the ring
    report["fingerprint"] = _fingerprint(net)
    report["rest_fingerprint"] = _rest_fingerprint(net)
    return report


@contextlib.contextmanager
def timed_install(installing: str, fixed: dict[str, float], took: list[float]) -> Iterator[None]:
    """The engine's install module imported now, timed into ``fixed`` (``install_import_s``: what the
    install's first call imports), and its ``install_layers`` timed into ``took`` where its callers
    find it (they import it at their first call)."""
    t0 = time.perf_counter()
    module = importlib.import_module(installing)
    fixed["install_import_s"] = time.perf_counter() - t0
    real = module.install_layers

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            took[0] += time.perf_counter() - t0

    with mock.patch.object(module, "install_layers", timed):
        yield


def _load(loader: Any, net: Any, config: Any, split: Split, form: str, probe: ProbeTimer,
          fixed: dict[str, float]) -> float:
    """The loader's ``load_weights``; the seconds megamoe's install took (``--load-format megamoe``),
    and in ``fixed`` what its first call imports (the install's modules: ``install_import_s``)."""
    real = loader.get_all_weights
    counted = mock.patch.object(loader, "get_all_weights", lambda mc, m: split.wrap(real(mc, m)))
    if form != "megamoe":
        with counted:
            loader.load_weights(net, config.model_config)
        return 0.0
    took = [0.0]
    with timed_install("megamoe_convert.engines.vllm.installing", fixed, took), probe.timing(), counted:
        loader.load_weights(net, config.model_config)
    return took[0]


def _ring_report(marks: dict[str, float]) -> dict[str, Any]:
    """The staging ring megamoe's loader pins in the background (on a GPU): how long pinning took,
    and when it was ready against the model build's end (negative: before it)."""
    staging = sys.modules.get("megamoe_convert.serve.staging")
    ring = getattr(staging, "_RING", None)
    if ring is None:
        return {}
    return {"ring_pin_s": ring.pin_seconds, "ring_ready_after_build_s": ring.ready_at - marks["construct"]}


@contextlib.contextmanager
def _cuda_platform(device: Any) -> Iterator[None]:
    """vLLM's CPU platform stands in on the GPU machine (no compiled libraries there): the
    safetensors iterator asks it which device to load onto."""
    if device.type != "cuda":
        yield
        return
    from node_forms import _cuda_platform as cuda

    with cuda():
        yield


def cuda_device(on_gpu: bool) -> Any:
    """The rank's device: GPU 0 with its CUDA context made now (the ``cuda`` phase), else the CPU."""
    import torch

    if not on_gpu:
        return torch.device("cpu")
    torch.cuda.init()
    device = torch.device("cuda", 0)
    torch.empty(1, device=device)
    return device


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _phases(marks: dict[str, float]) -> dict[str, float]:
    names = list(marks)
    return {b: round(marks[b] - marks[a], 4) for a, b in zip(names, names[1:], strict=False)}


def _fingerprint(net: Any) -> str:
    """xxh3-128 of what the MegaMoE kernels read, every layer (bench_startup.fingerprint)."""
    import vllm_harness as h
    from bench_startup import fingerprint

    experts = [m for m in net.modules() if isinstance(m, h.mega_py.DeepGemmMegaMoEExperts)]
    return fingerprint([t for m in experts for t in h.kernel_view(m)])


def _rest_fingerprint(net: Any) -> str:
    """xxh3-128 of every parameter outside the MegaMoE experts, after post-processing: its name,
    dtype, shape and bytes, in name order (what the model serves with besides the experts)."""
    import vllm_harness as h

    experts = [m for m in net.modules() if isinstance(m, h.mega_py.DeepGemmMegaMoEExperts)]
    return parameters_fingerprint(net, experts)


def parameters_fingerprint(net: Any, skipped: list[Any]) -> str:
    """xxh3-128 of every parameter outside the ``skipped`` modules: name, dtype, shape and bytes, in name order."""
    import torch
    import xxhash

    experts = {id(p) for m in skipped for p in m.parameters()}
    digest = xxhash.xxh3_128()
    for name, param in sorted(net.named_parameters()):
        if id(param) in experts:
            continue
        digest.update(f"{name} {param.dtype} {tuple(param.shape)}\n".encode())
        digest.update(param.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def main(argv: dict[str, Any], start: float) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's logger and every print: to the log, never into the report
    if argv["role"] == "source":
        report = write_source(Path(argv["model"]), argv["rank"], argv["ep_size"], argv["ranks"])
    else:
        report = rank_main(argv["role"], argv["rank"], argv["ep_size"], argv["model"], argv["port"], start,
                           argv["spawned"])
    protocol.write(json.dumps(report) + "\n")
