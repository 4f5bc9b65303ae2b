"""Real vLLM modules on the CPU, built and loaded by vLLM's own code.

Only what needs hardware or a process group is patched: the SM100 capability check, the
pipeline/EP groups, (0.33) the weight cache's IPC platform check, device UUID and groups, and
(0.30-0.32) DeepGEMM's compiled ``transform_sf_into_required_layout``,
which cannot run on a CPU: it is replaced by the project's spec-exact equivalent
(``megamoe_convert.layout.scales.sf_into_required_layout``) while DeepGEMM's own Python
``transform_weights_for_mega_moe`` (bundled in vLLM) does the rest.

The model trees are vLLM's own classes (``DeepseekV4ForCausalLM``, ``DeepseekV4Model``,
``DeepseekV4MoE``, ``DeepSeekV4MTP``) holding real MegaMoE experts modules built with the
arguments ``DeepseekV4MoE._init_mega_moe_experts`` passes; attention and dense layers are left
out (their constructors need a GPU attention backend). Loading goes through vLLM's own
``safetensors_weights_iterator``, the model's ``hf_to_vllm_mapper`` and ``load_weights`` (its
own name mapping) and the experts' ``weight_loader``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Iterator
from unittest import mock

import torch
import vllm
from torch import nn
from trees import bare as _bare

from megamoe_convert.layout import scales

VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
#: vLLM >= 0.33 builds DeepGemmMegaMoEExperts (kernel layout); before, DeepseekV4MegaMoEExperts (finalize).
KERNEL_LAYOUT = VERSION >= (0, 33)

model_py = importlib.import_module("vllm.models.deepseek_v4.nvidia.model")
mtp_py = importlib.import_module("vllm.models.deepseek_v4.nvidia.mtp")
#: 0.32: the backend factory; >= 0.33: the experts class and its formats; absent in 0.30-0.31.
mega_py = (importlib.import_module("vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe")
           if importlib.util.find_spec("vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe") else None)


# --------------------------------------------------------------------------------------
# Patches: hardware and process groups only
# --------------------------------------------------------------------------------------

def _bundled_deep_gemm() -> types.ModuleType:
    """vLLM's bundled DeepGEMM Python (``vllm/third_party/deep_gemm``) without its CUDA ``_C``:
    its real ``transform_weights_for_mega_moe``; the SM100-only C++ scale transform replaced by
    the project's spec-exact equivalent."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "third_party" / "deep_gemm"
    package = types.ModuleType("vllm.third_party.deep_gemm")
    package.__path__ = [str(root)]
    compiled = types.ModuleType("_C")  # every compiled entry point: present, and refusing to run here

    def no_cuda(name: str):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"deep_gemm._C.{name} needs DeepGEMM's CUDA extension")
        return refuse

    compiled.__getattr__ = no_cuda
    with mock.patch.dict(sys.modules, {"vllm.third_party.deep_gemm": package,
                                       "vllm.third_party.deep_gemm._C": compiled}):
        mega = importlib.import_module("vllm.third_party.deep_gemm.mega")
    deep_gemm = types.ModuleType("deep_gemm")
    deep_gemm.transform_weights_for_mega_moe = mega.transform_weights_for_mega_moe

    def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, **_):
        assert tuple(recipe) == (1, 32) and sf.dtype == torch.float32 and sf.shape[-2:] == (mn, k // 32)
        return scales.sf_into_required_layout(scales.narrow_fp32_to_ue8m0(sf))

    deep_gemm.transform_sf_into_required_layout = transform_sf_into_required_layout
    return deep_gemm


@contextlib.contextmanager
def patched(ep_rank: int = 0, ep_size: int = 1) -> Iterator[None]:
    ep_group = types.SimpleNamespace(rank_in_group=ep_rank, world_size=ep_size)
    pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1)
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(mock.patch("vllm.distributed.get_ep_group", lambda: ep_group))
        enter(mock.patch.object(model_py, "get_pp_group", lambda: pp_group, create=True))
        for module in (model_py, mtp_py):  # one TP rank: TP=1 is how DP+EP serving runs
            enter(mock.patch.object(module, "get_tensor_model_parallel_world_size", lambda: 1, create=True))
            enter(mock.patch.object(module, "get_tensor_model_parallel_rank", lambda: 0, create=True))
        if KERNEL_LAYOUT:
            enter(mock.patch.object(mega_py, "check_deep_gemm_mega_moe_supported", lambda *a, **k: None))
            # whether the installed DeepGEMM build's kernel takes shared-expert arguments
            enter(mock.patch.object(mega_py.DeepGemmMegaMoEExperts, "_kernel_fuses_shared_experts",
                                    lambda self, spec: True))
        else:
            if mega_py is not None:  # 0.32: a backend factory
                backend = mega_py.DeepGemmSm100MegaMoEBackend
                enter(mock.patch.object(model_py, "get_deep_gemm_mega_moe_backend", lambda *a, **k: backend()))
            else:  # 0.30-0.31: the module asks CUDA for the device's capability itself
                enter(mock.patch("torch.cuda.get_device_capability", lambda *a, **k: (10, 0)))
            enter(module_named("deep_gemm", _bundled_deep_gemm()))
            _fresh_deep_gemm_import(stack)
        yield


def _fresh_deep_gemm_import(stack: contextlib.ExitStack) -> None:
    """vLLM caches its DeepGEMM import for the process (``functools.cache``): a call outside the block
    (``None`` on the CPU) must not stand in for the block's module, nor the block's outlive it."""
    from vllm.utils import deep_gemm

    clear = getattr(deep_gemm._import_deep_gemm, "cache_clear", None)
    if clear is not None:
        clear()
        stack.callback(clear)


@contextlib.contextmanager
def module_named(name: str, module: types.ModuleType) -> Iterator[None]:
    """``sys.modules[name]`` is ``module`` for the block, and only that key is put back after it
    (``mock.patch.dict`` would also drop every module first imported inside the block, so a later
    import would make a second copy of each, with classes of their own)."""
    before = sys.modules.get(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        if before is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = before


#: vLLM >= 0.33's weight cache: its daemon, its engine-side ``IpcModelLoader``, their protocol.
WEIGHT_CACHE = "vllm.model_executor.model_loader.weight_cache"
#: The device UUID the daemon and the engine both report (vLLM hashes it into the socket's name).
DEVICE_UUID = "GPU-vllm-harness"


def weight_cache(name: str) -> types.ModuleType:
    """A module of vLLM's weight cache (``daemon``, ``ipc_loader``, ``protocol``): 0.33+ only."""
    return importlib.import_module(f"{WEIGHT_CACHE}.{name}")


@contextlib.contextmanager
def weight_cache_patched(ep_rank: int = 0, ep_size: int = 1) -> Iterator[None]:
    """:func:`patched`, and what vLLM's weight cache asks of an accelerator and of process groups,
    so that its own daemon, export and ``IpcModelLoader`` run in one process per role: the IPC
    platform check, the device UUID, the engine's groups (one rank: TP = PP = DP = 1) and, without
    a CUDA device, the accelerator's device index and cache."""
    one = types.SimpleNamespace(world_size=1, rank_in_group=0)
    ipc, daemon = weight_cache("ipc_loader"), weight_cache("daemon")
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(patched(ep_rank, ep_size))
        for module in (ipc, daemon):
            enter(mock.patch.object(module, "get_current_device_uuid", lambda: DEVICE_UUID))
        enter(mock.patch.object(ipc, "check_ipc_platform_support", lambda: None))
        for name in ("get_dp_group", "get_pp_group"):
            enter(mock.patch.object(ipc, name, lambda: one))
        enter(mock.patch.object(ipc, "get_tensor_model_parallel_world_size", lambda: 1))
        enter(mock.patch.object(ipc, "get_tensor_model_parallel_rank", lambda: 0))
        if not torch.cuda.is_available():
            enter(mock.patch("torch.accelerator.current_device_index", lambda: 0))
            enter(mock.patch("torch.accelerator.empty_cache", lambda: None))
        yield


# --------------------------------------------------------------------------------------
# Model trees of vLLM's own classes
# --------------------------------------------------------------------------------------

#: Fields vLLM's ``load_weights`` reads for attention slicing only (no attention tensor is fed).
ATTENTION_DEFAULTS = {"num_attention_heads": 1}


def hf_config(ckpt: Path) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**ATTENTION_DEFAULTS, **json.loads((ckpt / "config.json").read_text())})


def make_experts(config, prefix: str, ep_rank: int, ep_size: int, redundant: int, **overrides) -> nn.Module:
    """The experts module with the arguments ``DeepseekV4MoE._init_mega_moe_experts`` passes."""
    n_physical = config.n_routed_experts + redundant
    local = n_physical // ep_size
    kwargs = dict(num_experts=n_physical, num_local_experts=local, experts_start_idx=ep_rank * local,
                  num_logical_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                  hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size, prefix=prefix)
    from vllm.config import VllmConfig

    if KERNEL_LAYOUT:
        kwargs.update(activation=mega_py.MegaMoEActivation("swiglu", clamp=float(config.swiglu_limit)),
                      weight_format=mega_py.MEGA_MOE_MXFP4)
        kwargs.update(overrides)
        return mega_py.DeepGemmMegaMoEExperts(VllmConfig(), **kwargs)
    kwargs.update(overrides)
    return model_py.DeepseekV4MegaMoEExperts(VllmConfig(), num_shared_experts=config.n_shared_experts or 0, **kwargs)


def fusable_shared_mlp(config) -> nn.Module:
    """What ``DeepGemmMegaMoEExperts`` reads of the shared MLP it is offered (``_fusable_shared_experts``):
    the shapes and dtypes of ``gate_up_proj`` / ``down_proj`` weights and UE8M0 128x128 block scales,
    as vLLM's FP8 linears hold a DeepSeek-V4 checkpoint's shared expert."""
    h, s = config.hidden_size, config.moe_intermediate_size * config.n_shared_experts

    def linear(n: int, k: int) -> nn.Module:
        return _bare(nn.Module, weight=torch.zeros(n, k, dtype=torch.float8_e4m3fn),
                     weight_scale_inv=torch.zeros(n // 128, k // 128, dtype=torch.float8_e8m0fnu))

    return _bare(nn.Module, gate_up_proj=linear(2 * s, h), down_proj=linear(h, s))


def _moe(experts: nn.Module) -> nn.Module:
    return _bare(model_py.DeepseekV4MoE, use_native_mega_moe=True, use_mega_moe=True,  # 0.32+ / 0.30-0.31
                 experts=experts, shared_experts=None,
                 prefix=experts.prefix.removesuffix(".experts"))


def build_main_model(config, ep_rank: int, ep_size: int, redundant: int, **overrides) -> nn.Module:
    """``DeepseekV4ForCausalLM`` > ``DeepseekV4Model`` > ``layers[i].ffn`` (``DeepseekV4MoE``) > experts
    (``overrides``: more ``DeepGemmMegaMoEExperts`` arguments, e.g. ``weight_format``)."""
    n = config.num_hidden_layers
    layers = nn.ModuleList()
    for i in range(n):
        block = nn.Module()
        block.ffn = _moe(make_experts(config, f"model.layers.{i}.ffn.experts", ep_rank, ep_size, redundant,
                                      **overrides))
        layers.append(block)
    model = _bare(model_py.DeepseekV4Model, config=config, quant_config=None, use_sequence_parallel=False,
                  start_layer=0, end_layer=n, layers=layers)
    return _bare(model_py.DeepseekV4ForCausalLM, config=config, model=model)


def build_mtp_model(config, ep_rank: int, ep_size: int, redundant: int, **overrides) -> nn.Module:
    """``DeepSeekV4MTP`` > predictor > ``layers[str(N + i)].mtp_block.ffn`` > experts."""
    n, k = config.num_hidden_layers, config.num_nextn_predict_layers
    layers = nn.ModuleDict()
    for i in range(k):
        block, layer = nn.Module(), nn.Module()
        block.ffn = _moe(make_experts(config, f"model.layers.{n + i}.mtp_block.ffn.experts", ep_rank, ep_size,
                                      redundant, **overrides))
        layer.mtp_block = block
        layers[str(n + i)] = layer
    predictor = _bare(nn.Module, layers=layers, mtp_start_layer_idx=n, num_mtp_layers=k)
    return _bare(mtp_py.DeepSeekV4MTP, config=config, quant_config=None, pad_shared_expert=False, model=predictor)


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    return {m.prefix: m for m in model.modules() if hasattr(m, "experts_start_idx")}


# --------------------------------------------------------------------------------------
# vLLM's own loading path
# --------------------------------------------------------------------------------------

def checkpoint_weights(ckpt: Path, only_experts: bool = True, shared: bool = False,
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """vLLM's own safetensors iterator over the checkpoint files, in file order: the routed experts
    (and with ``shared``, the shared experts), or everything."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    for name, tensor in safetensors_weights_iterator(files, False):
        if not only_experts or ".ffn.experts." in name or (shared and ".ffn.shared_experts." in name):
            yield name, tensor


def vllm_load(main: nn.Module, mtp: nn.Module, ckpt: Path, shared: bool = False) -> None:
    """What vLLM does with the checkpoint: the main model's ``load_weights`` (through its own
    ``hf_to_vllm_mapper``; 0.30-0.32 finalize there), and the MTP draft's own ``load_weights``.
    ``shared``: the shared experts too (the modules fuse them)."""
    main.load_weights(checkpoint_weights(ckpt, shared=shared))
    mtp.load_weights(checkpoint_weights(ckpt, shared=shared))
    if not KERNEL_LAYOUT:
        for moe in (m for m in mtp.modules() if isinstance(m, model_py.DeepseekV4MoE)):
            moe.finalize_mega_moe_weights()  # vLLM's MTP model finalizes in process_weights_after_loading


# --------------------------------------------------------------------------------------
# What the kernel and EPLB read
# --------------------------------------------------------------------------------------

def kernel_view(experts: nn.Module) -> list[torch.Tensor]:
    """The four tensors ``forward`` hands the kernel (l1 weight, l1 scales, l2 weight, l2 scales)."""
    if KERNEL_LAYOUT:
        return [*experts.l1_weights, *experts.l2_weights]
    return [*experts._transformed_l1_weights, *experts._transformed_l2_weights]


def assert_same_tensors(got: list[torch.Tensor], want: list[torch.Tensor], where: str) -> None:
    assert len(got) == len(want), f"{where}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g is not None, f"{where}[{i}] is None"
        assert (g.dtype, tuple(g.shape), g.stride()) == (w.dtype, tuple(w.shape), w.stride()), \
            f"{where}[{i}]: {g.dtype}{tuple(g.shape)}{g.stride()} vs {w.dtype}{tuple(w.shape)}{w.stride()}"
        assert torch.equal(g, w), f"{where}[{i}]: bytes differ"


# --------------------------------------------------------------------------------------
# The shared expert: vLLM's own FP8 MLP, and vLLM's own fusion decision
# --------------------------------------------------------------------------------------

@contextlib.contextmanager
def fp8_linears(tp_size: int = 1) -> Iterator[None]:
    """vLLM's FP8 block linears on the CPU: a TP group of ``tp_size`` (this is rank 0), the
    model dtype ``Fp8LinearMethod`` reads, its GEMM kernel choice (needs AMX or a GPU; never run
    here) and, 0.32, whether the DeepGEMM build's kernel takes shared experts."""
    tp_group = types.SimpleNamespace(world_size=tp_size, rank_in_group=0)
    model_config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16, hf_config=None))
    fp8 = "vllm.model_executor.layers.quantization.fp8"
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(mock.patch("vllm.distributed.parallel_state.get_tp_group", lambda: tp_group))
        enter(mock.patch(f"{fp8}.get_current_vllm_config", lambda: model_config))
        enter(mock.patch(f"{fp8}.init_fp8_linear_kernel", lambda *a, **k: None))
        if not KERNEL_LAYOUT:
            enter(mock.patch.object(mega_py.DeepGemmSm100MegaMoEBackend, "supports_shared_experts",
                                    lambda self, deep_gemm: True))
        yield


def shared_mlp(config, layer_prefix: str) -> nn.Module:
    """The layer's ``DeepseekV4MLP`` as vLLM builds it for a DeepSeek-V4 FP4 checkpoint: FP8 e4m3
    linears with UE8M0 128x128 block scales (``DeepseekV4FP8Config``), TP-sharded unless TP=1."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.models.deepseek_v4.quant_config import DeepseekV4FP8Config

    quant = DeepseekV4FP8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
    with set_current_vllm_config(VllmConfig()):  # its activation is a CustomOp
        return model_py.DeepseekV4MLP(hidden_size=config.hidden_size,
                                      intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                                      hidden_act="silu", swiglu_limit=config.swiglu_limit, quant_config=quant,
                                      reduce_results=True, is_sequence_parallel=False,
                                      prefix=f"{layer_prefix}.shared_experts")


def build_main_model_with_shared(config, ep_rank: int, ep_size: int, redundant: int, tp_size: int = 1) -> nn.Module:
    """The main model whose MoE blocks hold a real shared MLP and whose experts vLLM's own
    ``DeepseekV4MoE._init_mega_moe_experts`` builds: vLLM decides whether to fuse (TP=1 or
    sequence parallel, ``VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION`` unset)."""
    from vllm.config import VllmConfig

    vllm_config = VllmConfig()
    vllm_config.parallel_config.eplb_config.num_redundant_experts = redundant
    n = config.num_hidden_layers
    layers = nn.ModuleList()
    ep_group = types.SimpleNamespace(rank_in_group=ep_rank, world_size=ep_size)
    with mock.patch.object(model_py, "get_ep_group", lambda: ep_group):
        for i in range(n):
            prefix = f"model.layers.{i}.ffn"
            moe = _bare(model_py.DeepseekV4MoE, use_native_mega_moe=True, use_mega_moe=True, prefix=prefix,
                        shared_experts=shared_mlp(config, f"model.layers.{i}"), use_sequence_parallel=False,
                        tp_size=tp_size, n_routed_experts=config.n_routed_experts,
                        n_activated_experts=config.num_experts_per_tok, swiglu_limit=config.swiglu_limit)
            model_py.DeepseekV4MoE._init_mega_moe_experts(moe, vllm_config, config, prefix)
            block = nn.Module()
            block.ffn = moe
            layers.append(block)
    model = _bare(model_py.DeepseekV4Model, config=config, quant_config=None, use_sequence_parallel=False,
                  start_layer=0, end_layer=n, layers=layers)
    return _bare(model_py.DeepseekV4ForCausalLM, config=config, model=model)


def layer_state(moe: nn.Module) -> dict[str, torch.Tensor | None]:
    """Everything loading leaves in one MoE block that the kernel or EPLB reads: the experts'
    parameters (0.33: with ``shared_l*`` when fused), 0.30-0.32 the ``_transformed_*`` tuples, and
    the shared MLP's parameters while the block still has one."""
    state: dict[str, torch.Tensor | None] = {f"experts.{k}": v for k, v in moe.experts.named_parameters()}
    for name in ("l1", "l2", "shared_l1", "shared_l2"):
        pair = getattr(moe.experts, f"_transformed_{name}_weights", None)
        for i, t in enumerate(pair or ()):
            state[f"experts._transformed_{name}_weights[{i}]"] = t
    if moe.shared_experts is not None:
        state.update({f"shared_experts.{k}": v for k, v in moe.shared_experts.named_parameters()})
    return state
