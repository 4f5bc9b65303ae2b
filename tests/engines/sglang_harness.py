"""Real SGLang modules on the CPU, built and loaded by SGLang's own code.

Only what needs hardware is patched: the platform reports an SM100 CUDA machine (SGLang's own
``override_platform``), ``fp8.py``'s CPU branch is off, and DeepGEMM's compiled
``transform_sf_into_required_layout`` (SM100 only) is replaced by the project's spec-exact
equivalent; SGLang's ``mega_moe.py`` does the rest. ``torchvision`` (imported by SGLang's vision
configs at import time; PyPI has only CUDA builds, which cannot load against a CPU torch) is an
empty stand-in.

The topology is SGLang's own: ``ServerArgs`` published for the rank (``publish``), MoE flags from
``initialize_moe_config``, the expert-location table from ``compute_initial_expert_location_metadata``.
The model trees are SGLang's own classes (``DeepseekV4ForCausalLM``, ``DeepseekV4ForCausalLMNextN``)
holding real ``FusedMoE`` experts built with the arguments ``DeepseekV2MoE`` passes; attention and
dense layers are left out (their constructors need a GPU). Loading goes through SGLang's
safetensors iterator, the model's own ``load_weights`` (name mapping, expert mapping,
``weight_loader``) and the quant method's ``process_weights_after_loading``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Iterator
from unittest import mock


class _EmptyModule(types.ModuleType):
    """Any attribute is another empty module: enough for import-time ``from torchvision... import X``."""

    def __getattr__(self, name: str) -> "_EmptyModule":
        if name.startswith("__"):
            raise AttributeError(name)
        return _EmptyModule(f"{self.__name__}.{name}")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _EmptyModule(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers then treats it as too old to use


sys.meta_path.insert(0, _TorchvisionStandIn())
#: The same stand-in as source, for a subprocess (``bare_env``: SGLang without megamoe-convert).
TORCHVISION_STAND_IN = "\n".join(["import importlib.abc, importlib.machinery, sys, types",
                                  inspect.getsource(_EmptyModule), inspect.getsource(_TorchvisionStandIn),
                                  "sys.meta_path.insert(0, _TorchvisionStandIn())", ""])

import sglang.srt.layers.quantization.fp8 as fp8_py  # noqa: E402
import torch  # noqa: E402
from sglang.srt.eplb import expert_location  # noqa: E402
from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class  # noqa: E402
from sglang.srt.layers.moe.utils import initialize_moe_config  # noqa: E402
from sglang.srt.layers.quantization.fp8 import Fp8Config  # noqa: E402
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402
from sglang.srt.models.deepseek_v4_nextn import DeepseekV4ForCausalLMNextN  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, override_platform, publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from torch import nn  # noqa: E402
from trees import bare as _bare  # noqa: E402

from megamoe_convert.layout import scales  # noqa: E402

#: The tiny preset with hidden_size 512: SGLang's MegaMoE needs hidden % 512 == 0.
CONFIG = {**json.loads((Path(__file__).resolve().parents[2] / "configs" / "tiny.json").read_text()),
          "hidden_size": 512}


# --------------------------------------------------------------------------------------
# Patches: hardware only
# --------------------------------------------------------------------------------------

def _deep_gemm() -> types.ModuleType:
    """DeepGEMM's one entry point SGLang's MegaMoE build calls, spec-exact on the CPU."""
    module = types.ModuleType("deep_gemm")

    def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, disable_ue8m0_cast=False, **_):
        assert tuple(recipe) == (1, 32) and sf.dtype == torch.float32 and not disable_ue8m0_cast
        assert sf.shape[-2:] == (mn, k // 32)
        return scales.sf_into_required_layout(scales.narrow_fp32_to_ue8m0(sf))

    module.transform_sf_into_required_layout = transform_sf_into_required_layout
    return module


def hf_config(ckpt: Path) -> types.SimpleNamespace:
    return types.SimpleNamespace(**json.loads((ckpt / "config.json").read_text()))


@contextlib.contextmanager
def one_module(name: str, module: types.ModuleType | None) -> Iterator[None]:
    """``sys.modules[name]`` is ``module`` meanwhile, and no other key changes: ``mock.patch.dict``
    would put the whole dict back, dropping every module imported meanwhile, so that a later import
    makes a second copy of it, with state of its own (a second staging ring, for one)."""
    missing = object()
    before = sys.modules.get(name, missing)
    sys.modules[name] = module  # type: ignore[assignment]
    try:
        yield
    finally:
        if before is missing:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = before  # type: ignore[assignment]


@contextlib.contextmanager
def patched(ep_rank: int, ep_size: int, redundant: int, **server_args) -> Iterator[types.SimpleNamespace]:
    """SGLang's topology for one rank of ``--moe-a2a-backend megamoe`` (TP = EP, DP attention off)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(override_platform(is_cuda=True, is_sm100=True))
        stack.enter_context(one_module("deep_gemm", _deep_gemm()))
        stack.enter_context(mock.patch.object(fp8_py, "_is_cpu", False))
        args = ServerArgs(model_path="dummy", tp_size=ep_size, ep_size=ep_size, moe_a2a_backend="megamoe",
                          ep_num_redundant_experts=redundant, device="cpu", **server_args)
        reset_context()
        stack.callback(reset_context)
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=ep_rank, dp_rank=None))
        initialize_moe_config()
        yield args


def set_expert_location(config: types.SimpleNamespace, ep_rank: int) -> None:
    """SGLang's own initial expert-location table (``--init-expert-location``, default trivial); the
    model class is DeepSeek-V4's (resolving it through the registry would import every model)."""
    model_config = types.SimpleNamespace(hf_config=config)
    for_model = staticmethod(lambda m: DeepseekV4ForCausalLM.get_model_config_for_expert_location(m.hf_config))
    with mock.patch.object(expert_location.ModelConfigForExpertLocation, "from_model_config", for_model):
        table = expert_location.compute_initial_expert_location_metadata(model_config, ep_rank)
    expert_location.set_global_expert_location_metadata(table, allow_overwrite=True)


# --------------------------------------------------------------------------------------
# Model trees of SGLang's own classes
# --------------------------------------------------------------------------------------

def quant_config() -> Fp8Config:
    """What SGLang's loader builds for DeepSeek-V4 (fp8 block quant, MXFP4 experts)."""
    config = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128])
    config.is_fp4_experts = True
    return config


def make_experts(config, prefix: str, layer_id: int, redundant: int, uses_expert_location: bool,
                 qc: Fp8Config) -> nn.Module:
    """The experts module with the arguments ``DeepseekV2MoE.__init__`` passes (no fused shared experts)."""
    return get_moe_impl_class(qc)(
        num_experts=config.n_routed_experts + redundant, num_fused_shared_experts=0,
        top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size, layer_id=layer_id, quant_config=qc,
        routed_scaling_factor=config.routed_scaling_factor, swiglu_limit=config.swiglu_limit,
        prefix=prefix, uses_expert_location=uses_expert_location)


def _block(experts: nn.Module) -> nn.Module:
    block = nn.Module()
    block.mlp = nn.Module()
    block.mlp.experts = experts
    return block


#: What ``load_weights`` reads off the model besides the layers; ``post_load_weights`` and the
#: MHC prewarm only touch attention, which the trees leave out.
def _model_attributes(config, qc) -> dict:
    pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1)
    return dict(config=config, quant_config=qc, wo_a_fp8=False, num_fused_shared_experts=0, vision=None,
                pp_group=pp_group, post_load_weights=lambda **_: None, _prewarm_mhc_kernels=lambda: None)


def build_main_model(config, ep_rank: int, redundant: int) -> nn.Module:
    """``DeepseekV4ForCausalLM`` > ``model.layers[i].mlp.experts`` (``FusedMoE``)."""
    set_expert_location(config, ep_rank)
    qc = quant_config()
    n = config.num_hidden_layers
    layers = nn.ModuleList(_block(make_experts(config, f"model.layers.{i}.mlp.experts", i, redundant, True, qc))
                           for i in range(n))
    inner = _bare(nn.Module, layers=layers, start_layer=0, end_layer=n)
    return _bare(DeepseekV4ForCausalLM, model=inner, **_model_attributes(config, qc))


def build_on_any_device(config, ep_rank: int, redundant: int) -> nn.Module:
    """:func:`build_main_model` under whatever default device a loader sets (``meta`` for the weight
    cache's engine and presharded's signature): the expert-location table is host data SGLang
    computes before any model is built, so it is computed on the CPU first."""
    with torch.device("cpu"):
        set_expert_location(config, ep_rank)
    with mock.patch(f"{__name__}.set_expert_location", lambda *_: None):
        return build_main_model(config, ep_rank, redundant)


def build_nextn_model(config) -> nn.Module:
    """``DeepseekV4ForCausalLMNextN`` > ``model.decoder.mlp.experts``: built as ``DeepseekV2MoE``
    builds DeepSeek-V4's NextN layer, without expert location or redundant experts."""
    qc = quant_config()
    inner = _bare(nn.Module, decoder=_block(make_experts(config, "model.decoder.mlp.experts", 0, 0, False, qc)))
    return _bare(DeepseekV4ForCausalLMNextN, model=inner, **_model_attributes(config, qc))


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    return {m.layer_name: m for m in model.modules() if hasattr(m, "moe_ep_rank")}


# --------------------------------------------------------------------------------------
# SGLang's own loading path
# --------------------------------------------------------------------------------------

def checkpoint_weights(ckpt: Path, only_experts: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    for name, tensor in safetensors_weights_iterator(files):
        if not only_experts or ".ffn.experts." in name:
            yield name, tensor


def post_process(model: nn.Module) -> None:
    """What SGLang's loader runs after ``load_weights``: every quant method's post-processing."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def sglang_load(model: nn.Module, ckpt: Path) -> None:
    model.load_weights(checkpoint_weights(ckpt))
    post_process(model)


# --------------------------------------------------------------------------------------
# What the kernel, DeepEP and EPLB read
# --------------------------------------------------------------------------------------

#: Every tensor a built MegaMoE experts module exposes.
PARAMETERS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv",
              "mega_w13_weight_scale_utccp", "mega_w2_weight_scale_utccp")


def state(experts: nn.Module) -> dict[str, torch.Tensor]:
    return {**{n: getattr(experts, n) for n in PARAMETERS},
            **{f"mega_l{g}_weights[{i}]": getattr(experts, f"mega_l{g}_weights")[i] for g in (1, 2) for i in (0, 1)}}


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert (got.dtype, tuple(got.shape), got.stride()) == (want.dtype, tuple(want.shape), want.stride()), \
        f"{where}: {got.dtype}{tuple(got.shape)}{got.stride()} vs {want.dtype}{tuple(want.shape)}{want.stride()}"
    assert torch.equal(got, want), f"{where}: bytes differ"


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
