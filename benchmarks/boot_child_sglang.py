"""The rank process of ``bench_boot.py --engine sglang``: one rank's start with SGLang 0.5.23, from the
interpreter to a loaded model, every phase timed.

The model is SGLang's own class of the checkpoint's family (Qwen3-MoE's ``Qwen3MoeForCausalLM``):
every decoder layer's real attention, MoE block with its ``FusedMoE`` experts (FP8 128x128 blocks),
norms, embedding and head, built by SGLang's ``_initialize_model`` inside its own
``DefaultModelLoader.load_model``. The loader is SGLang's ``get_model_loader(LoadConfig(load_format=F))``:
``auto`` (SGLang alone, no plugin loaded) or ``megamoe`` (megamoe-convert's plugin loaded as SGLang's
processes load plugins, its loader class routed by it). Post-processing is SGLang's own: each quant
method's ``process_weights_after_loading``, ``build_sm90_mega_moe_experts_weights`` for the experts.

As ``node_forms_sglang.py`` runs SGLang on a GPU: its modules imported as on a machine without CUDA
(no compiled kernel package), the tensors on the GPU; the SM90 platform check patched
(``tests/engines/sglang_fp8_harness.py``), the topology SGLang's own for ``--moe-a2a-backend megamoe``
with TP = EP (``ServerArgs`` published for the rank, ``initialize_moe_config``, the initial
expert-location table). Stood in for: the pipeline and tensor-parallel groups (the ranks are no process
group: objects with their sizes and ranks, which the constructors read), and the rotary embedding's
kernel choice (the CPU platform's native one: the compiled one is absent).

Phases: ``imports`` (Python, torch, SGLang's modules and the family's model module), ``plugin``
(``megamoe``: the plugin's import, then SGLang's ``load_plugins``, which runs its ``register`` and
applies its hooks), ``cuda`` (the context), ``config`` (SGLang's ``ModelConfig``, through the hooked
``get_config`` under ``megamoe``), ``process_group`` (the topology above), ``loader``
(``get_model_loader``; megamoe's starts pinning its staging ring here), then ``load_model``'s parts,
split by wrapping SGLang's own functions: ``construct`` (to the end of ``_initialize_model``; the
quant config ``load_model`` makes before it is in this phase), ``weights`` (to the end of
``DefaultModelLoader.load_weights_only``: the iterator, the model's ``load_weights``), ``post`` (to
the end of ``load_model``: ``postprocess_weights`` and ``model.eval()``). Not split: the quant
config from the model build (one line before it, inside ``load_model``), and, under ``megamoe``, the
experts' install from the first non-expert reads (both run inside the iterator's first ``next``: the
install's own time is reported as ``weights_experts_s``).

The ``source`` role completes the synthesised source: every non-expert tensor SGLang's model (built on
``meta`` at TP 1) loads that the synth preset did not write, so no parameter is left unloaded.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

from boot_child import (
    SAFETENSORS_DTYPES,
    Split,
    _phases,
    _ring_report,
    _sync,
    cuda_device,
    parameters_fingerprint,
    tensor_bytes,
    timed_install,
)
from probe_timer import ProbeTimer

#: The family's model module (its class is what SGLang's registry resolves for the architecture).
MODEL_MODULES = {"qwen3_moe": "sglang.srt.models.qwen3_moe", "deepseek_v3": "sglang.srt.models.deepseek_v2"}
#: megamoe's staging ring and its reader of whole shards (the non-expert weights through the ring).
STAGING, TENSOR_STREAM = "megamoe_convert.serve.staging", "megamoe_convert.serve.tensor_stream"
#: What a routed expert's checkpoint name holds.
EXPERTS = ".mlp.experts."
#: SGLang's stacked parameters: fused name -> the checkpoint's names, in shard order.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: FP8 block scales: one per 128 x 128 block.
BLOCK = 128
#: The plugin's ``register``, as its ``sglang.srt.plugins`` entry point names it.
ENTRY_POINT = "megamoe_convert.engines.sglang.plugin:register"


def family_of(model: str) -> str:
    """The source's model type (a conversion's ``config.json`` keeps it in its ``megamoe`` section)."""
    raw = json.loads((Path(model) / "config.json").read_text())
    return str(raw.get("megamoe", {}).get("model_type") or raw["model_type"])


def entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == ENTRY_POINT for ep in entry_points(group="sglang.srt.plugins"))


def load_plugins(fixed: dict[str, float], form: str) -> None:
    """SGLang's ``load_plugins``, which every SGLang process runs (its scan of the entry points). Under
    ``megamoe`` the plugin as SGLang's processes load it: its import, then ``load_plugins`` (its
    ``register``, the hooks applied; where the entry point is not installed, a tree unpacked beside
    SGLang, ``register`` and the hooks' application are called as ``load_plugins`` would), timed as
    ``plugin_register_s``. Under ``auto`` the same call with this plugin left out, as on a machine
    without it, timed as ``engine_plugins_s``: what the report takes from ``megamoe``'s."""
    installed = entry_point_installed()
    if form == "megamoe":
        t0 = time.perf_counter()
        from megamoe_convert.engines.sglang import plugin
        fixed["plugin_import_s"] = time.perf_counter() - t0
    elif installed:
        os.environ["SGLANG_PLUGINS"] = "-"  # a name no plugin has: SGLang scans and loads none (nor another's)
    t0 = time.perf_counter()
    from sglang.srt.plugins import load_plugins as sglang_load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    sglang_load_plugins()
    if form == "megamoe" and not installed:
        plugin.register()
        HookRegistry.apply_hooks()
    fixed["plugin_register_s" if form == "megamoe" else "engine_plugins_s"] = time.perf_counter() - t0


@contextlib.contextmanager
def topology(f: types.ModuleType, rank: int, ep_size: int, hf_config: Any, family: str) -> Iterator[None]:
    """SGLang's topology for the rank (the harness's ``patched``: SM90, TP = EP), its initial
    expert-location table, the groups' stand-ins, and the rotary embedding's native kernel."""
    import torch
    from sglang.srt.layers.rotary_embedding import base as rotary
    from sglang.srt.runtime_context import get_parallel

    with f.patched(rank, ep_size, 0), mock.patch.object(rotary, "_is_cpu", True):
        with torch.device("cpu"):  # the table off the model's device, as the engine builds it
            f.set_expert_location(family, hf_config, rank)
        pp = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1, rank_in_group=0)
        tp = types.SimpleNamespace(world_size=ep_size, rank_in_group=rank, cpu_group=None)
        get_parallel().override_permanently(pp_group=pp, tp_group=tp)
        yield


@contextlib.contextmanager
def load_model_marks(marks: dict[str, float], device: Any, built: Callable[[], Any] = lambda: None) -> Iterator[None]:
    """``DefaultModelLoader.load_model``'s parts marked where SGLang's own functions end: the model
    built (``_initialize_model``; then ``built()``), the weights loaded (``load_weights_only``)."""
    from sglang.srt.model_loader import loader as loader_py

    def marking(fn: Any, mark: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            _sync(device)
            marks[mark] = time.perf_counter()
            if mark == "construct":
                built()
            return out
        return run

    default = loader_py.DefaultModelLoader
    with mock.patch.object(loader_py, "_initialize_model", marking(loader_py._initialize_model, "construct")), \
            mock.patch.object(default, "load_weights_only",
                              staticmethod(marking(default.load_weights_only, "weights"))):
        yield


# --------------------------------------------------------------------------------------
# The source: what synth wrote, completed from the model SGLang builds
# --------------------------------------------------------------------------------------

def checkpoint_names(model: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """(checkpoint name, safetensors dtype, shape) of every non-expert tensor SGLang's model loads (built
    at TP 1): its parameters outside the routed experts, stacked ones split into their shards."""
    modules = dict(model.named_modules())
    out = []
    for name, param in model.named_parameters():
        if EXPERTS in name:
            continue
        dtype, shape = SAFETENSORS_DTYPES[str(param.dtype).removeprefix("torch.")], tuple(param.shape)
        owner, _, _ = name.rpartition(".")
        fused = owner.rpartition(".")[2]
        if fused not in STACKED:
            out.append((name, dtype, shape))
            continue
        scale = name.endswith("_scale_inv")
        for part, size in zip(STACKED[fused], modules[owner].output_sizes, strict=True):
            rows = -(-size // BLOCK) if scale else size
            out.append((name.replace(f".{fused}.", f".{part}."), dtype, (rows, *shape[1:])))
    return out


def refuse_other_shapes(src: Path, weight_map: dict[str, str], names: list[tuple[str, str, tuple[int, ...]]]) -> None:
    """A tensor the source holds at another shape than the model's: SGLang narrows it per rank, so it
    fails on some ranks and loads short bytes on others; the measurement stops here instead."""
    from megamoe_convert.source.safetensors_io import read_header

    held = {name: entry.shape for f in sorted(set(weight_map.values()))
            for name, entry in read_header(src / f).tensors.items()}
    for name, _, shape in names:
        if name in held and held[name] != shape:
            raise SystemExit(f"{src}: {name}: shape {list(held[name])}, SGLang's model loads {list(shape)}")


def complete_source(src: Path) -> dict[str, Any]:
    """Every non-expert tensor SGLang's model loads that ``src`` lacks (the synth preset writes the
    attention's ``q_proj`` and ``o_proj`` only), written into one more file of its index."""
    import numpy as np
    import torch
    from node_forms_sglang import import_sglang

    from megamoe_convert.output.writer import write_json_atomic, write_safetensors
    from megamoe_convert.synth.tensors import SynthTensor

    f = import_sglang()
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import loader as loader_py

    model_config, load_config = ModelConfig(model_path=str(src)), LoadConfig()
    with topology(f, 0, 1, model_config.hf_config, family_of(str(src))):
        quant = loader_py._get_quantization_config(model_config, load_config)
        with loader_py.set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            names = checkpoint_names(loader_py._initialize_model(model_config, load_config, quant))
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    refuse_other_shapes(src, index["weight_map"], names)
    missing = [SynthTensor(n, d, s, "random" if d.startswith("F8") else "bf16")
               for n, d, s in names if n not in index["weight_map"]]
    if missing:
        rng = np.random.default_rng(1)
        write_safetensors(src / "rest-sglang.safetensors", src, [t.spec() for t in missing],
                          (tensor_bytes(t, rng) for t in missing), metadata={"format": "pt"}, fsync=False)
        index["weight_map"].update({t.name: "rest-sglang.safetensors" for t in missing})
        write_json_atomic(index_path, json.dumps(index), fsync=False)
    return {"added_tensors": len(missing)}


def rank_main(form: str, rank: int, ep_size: int, model: str, start: float, spawned: float) -> dict:
    """One rank's start (``form``: ``auto`` or ``megamoe``); the report of its phases."""
    marks: dict[str, float] = {"python": start}
    import torch
    from node_forms_sglang import device_config, import_sglang, kernel_report

    f = import_sglang()
    family = family_of(model)
    importlib.import_module(MODEL_MODULES[family])
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    marks["imports"] = time.perf_counter()
    fixed: dict[str, float] = {}
    load_plugins(fixed, form)
    marks["plugin"] = time.perf_counter()
    device = cuda_device(torch.cuda.device_count() > 0)  # SGLang imported as on a machine without CUDA
    marks["cuda"] = time.perf_counter()
    model_config = ModelConfig(model_path=model)
    marks["config"] = time.perf_counter()
    split, probe, took = Split(EXPERTS), ProbeTimer(), [0.0]
    with contextlib.ExitStack() as stack:
        stack.enter_context(topology(f, rank, ep_size, model_config.hf_config, family))
        marks["process_group"] = time.perf_counter()
        loader = get_model_loader(LoadConfig(load_format=form))
        marks["loader"] = time.perf_counter()
        real = loader._get_all_weights
        stack.enter_context(mock.patch.object(loader, "_get_all_weights", lambda mc, m: split.wrap(real(mc, m))))
        if form == "megamoe":  # the install's first call imports its module once the model is built
            install = timed_install("megamoe_convert.engines.sglang.installing", fixed, took)
            stack.enter_context(probe.while_building())
            stack.enter_context(load_model_marks(marks, device, lambda: stack.enter_context(install)))
            stack.enter_context(probe.timing())
        else:
            stack.enter_context(load_model_marks(marks, device))
        net = loader.load_model(model_config=model_config, device_config=device_config())
        _sync(device)
        marks["post"] = time.perf_counter()
        kernel = kernel_report(net)
        # Read here: the harness's patch of sys.modules takes every module the load imported out of it again
        ring, loaded = _ring_report(marks), {m: m in sys.modules for m in (STAGING, TENSOR_STREAM)}
    phases = _phases(marks)
    experts = took[0] if form == "megamoe" else split.seconds["experts"]
    report = {"form": form, "rank": rank, "phases": phases, "process_s": marks["post"] - start,
              "spawned_unix": spawned, "end_unix": time.time(), "model_class": type(net).__name__,
              "weights_experts_s": experts, "weights_rest_s": phases["weights"] - experts,
              "tensors": split.tensors, **fixed, **probe.report(), **ring,
              "parameters": sum(p.numel() for p in net.parameters()), "kernel_tuples": kernel["kernel_tuples"],
              "gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None}
    report["rest_staged"] = loaded[TENSOR_STREAM]  # the rest through the ring
    report["staging_loaded"] = loaded[STAGING]  # the experts' reader (its ring, on a GPU: ring_pin_s)
    moe = [m for m in net.modules() if hasattr(m, "moe_ep_rank")]  # SGLang's MoE experts modules
    report["experts_on"] = sorted({str(m.w13_weight.device) for m in moe})
    report["fingerprint"] = kernel["fingerprint"]
    report["rest_fingerprint"] = parameters_fingerprint(net, moe)
    return report


def main(argv: dict[str, Any], start: float) -> None:
    """One rank (``bench_boot.py --child``): its report, one JSON line on the original stdout."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # SGLang's logger and every print: to the log, never into the report
    if argv["role"] == "source":
        report = complete_source(Path(argv["model"]))
    else:
        report = rank_main(argv["role"], argv["rank"], argv["ep_size"], argv["model"], start, argv["spawned"])
    protocol.write(json.dumps(report) + "\n")
