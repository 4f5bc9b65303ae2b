"""SGLang's Hopper (SM90) FP8 MegaMoE on the CPU: real model classes, their ``load_weights``, the real
``Fp8MoEMethod`` and SGLang's own ``build_sm90_mega_moe_experts_weights``.

Only the platform is patched: SGLang's ``override_platform`` says this is an SM90 CUDA machine (what
``Fp8MoEMethod.process_weights_after_loading`` asks before it calls the SM90 build), and ``fp8.py``'s
CPU branch is off; the build itself only moves bytes, so it runs unchanged. The topology, quant
config and expert-location table are SGLang's own (``sglang_harness``). The model trees are SGLang's
classes (``DeepseekV3ForCausalLM``, ``DeepseekV3ForCausalLMNextN``, ``Qwen3MoeForCausalLM``) holding
real ``FusedMoE`` experts built with the arguments ``DeepseekV2MoE`` / ``Qwen3MoeSparseMoeBlock``
pass; attention and dense layers are left out (their constructors need a GPU).
"""

from __future__ import annotations

import contextlib
import json
import types
from pathlib import Path
from typing import Iterator
from unittest import mock

import sglang.srt.layers.quantization.fp8 as fp8_py
import sglang_harness as h  # noqa: F401  (the torchvision stand-in, installed before SGLang is imported)
import torch
from sglang.srt.eplb import expert_location
from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
from sglang.srt.layers.moe.utils import initialize_moe_config
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
from sglang.srt.runtime_context import SpawnRanks, override_platform, publish, reset_context
from sglang.srt.server_args import ServerArgs
from torch import nn
from trees import bare

#: family -> (SGLang's model class, its NextN class or None, the config key of its expert count)
CLASSES = {"deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3ForCausalLMNextN, "n_routed_experts"),
           "qwen3_moe": (Qwen3MoeForCausalLM, None, "num_experts")}


def hf_config(ckpt: Path) -> types.SimpleNamespace:
    return types.SimpleNamespace(**json.loads((ckpt / "config.json").read_text()))


@contextlib.contextmanager
def patched(ep_rank: int, ep_size: int, redundant: int, **server_args) -> Iterator[ServerArgs]:
    """SGLang's topology for one rank of ``--moe-a2a-backend megamoe`` on an SM90 machine (TP = EP)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(override_platform(is_cuda=True, is_sm90=True))
        stack.enter_context(mock.patch.object(fp8_py, "_is_cpu", False))
        stack.enter_context(h.one_module("deep_gemm", types.ModuleType("deep_gemm")))
        args = ServerArgs(model_path="dummy", tp_size=ep_size, ep_size=ep_size,
                          **{"moe_a2a_backend": "megamoe", **server_args},
                          ep_num_redundant_experts=redundant, device="cpu")
        reset_context()
        stack.callback(reset_context)
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=ep_rank, dp_rank=None))
        initialize_moe_config()
        yield args


def set_expert_location(family: str, config: types.SimpleNamespace, ep_rank: int) -> None:
    """SGLang's own initial expert-location table for the family's model class."""
    cls = CLASSES[family][0]
    model_config = types.SimpleNamespace(hf_config=config)
    for_model = staticmethod(lambda m: cls.get_model_config_for_expert_location(m.hf_config))
    with mock.patch.object(expert_location.ModelConfigForExpertLocation, "from_model_config", for_model):
        table = expert_location.compute_initial_expert_location_metadata(model_config, ep_rank)
    expert_location.set_global_expert_location_metadata(table, allow_overwrite=True)


def quant_config(config: types.SimpleNamespace) -> Fp8Config:
    """What SGLang's loader builds from the checkpoint's ``quantization_config`` (FP8, 128x128 blocks)."""
    return Fp8Config.from_config(config.quantization_config)


def make_experts(family: str, config, prefix: str, layer_id: int, redundant: int, qc: Fp8Config) -> nn.Module:
    """The experts module with the arguments the family's MoE block passes (no fused shared experts)."""
    n = getattr(config, CLASSES[family][2])
    common = dict(num_experts=n + redundant, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
                  intermediate_size=config.moe_intermediate_size, layer_id=layer_id, quant_config=qc, prefix=prefix)
    if family == "qwen3_moe":
        return get_moe_impl_class(qc)(**common)
    return get_moe_impl_class(qc)(**common, num_fused_shared_experts=0,
                                  routed_scaling_factor=config.routed_scaling_factor, uses_expert_location=True)


def _block(experts: nn.Module) -> nn.Module:
    block = nn.Module()
    block.mlp = nn.Module()
    block.mlp.experts = experts
    return block


def moe_layers(config) -> list[int]:
    first = getattr(config, "first_k_dense_replace", 0)
    return [i for i in range(config.num_hidden_layers) if i >= first]


def _attributes(config, qc) -> dict:
    pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1)
    return dict(config=config, quant_config=qc, num_fused_shared_experts=0, pp_group=pp_group,
                post_load_weights=lambda **_: None)


def build_main_model(family: str, config, ep_rank: int, redundant: int) -> nn.Module:
    """The family's model class > ``model.layers[i].mlp.experts`` (``FusedMoE``) for its MoE layers;
    its dense layers hold no experts (an empty block)."""
    set_expert_location(family, config, ep_rank)
    qc = quant_config(config)
    moe = set(moe_layers(config))
    layers = nn.ModuleList(_block(make_experts(family, config, f"model.layers.{i}.mlp.experts", i, redundant, qc))
                           if i in moe else nn.Module() for i in range(config.num_hidden_layers))
    inner = bare(nn.Module, layers=layers, start_layer=0, end_layer=config.num_hidden_layers)
    return bare(CLASSES[family][0], model=inner, **_attributes(config, qc))


def build_nextn_model(family: str, config, redundant: int) -> nn.Module:
    """``DeepseekV3ForCausalLMNextN`` > ``model.decoder.mlp.experts``: built as ``DeepseekV2MoE`` builds
    DeepSeek-V3's NextN layer (layer id 0, expert location and redundant experts, as a decoder layer)."""
    qc = quant_config(config)
    inner = bare(nn.Module, decoder=_block(make_experts(family, config, "model.decoder.mlp.experts", 0, redundant, qc)))
    return bare(CLASSES[family][1], model=inner, **_attributes(config, qc))


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    return {m.layer_name: m for m in model.modules() if hasattr(m, "moe_ep_rank")}


def checkpoint_weights(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """SGLang's safetensors iterator over the checkpoint's routed experts."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    for name, tensor in safetensors_weights_iterator(sorted(str(p) for p in ckpt.glob("*.safetensors"))):
        if ".mlp.experts." in name:
            yield name, tensor


def sglang_load(model: nn.Module, ckpt: Path) -> None:
    """SGLang's loading: the model's ``load_weights``, then every quant method's post-processing
    (``Fp8MoEMethod`` -> ``build_sm90_mega_moe_experts_weights``)."""
    model.load_weights(checkpoint_weights(ckpt))
    h.post_process(model)


#: What ``build_sm90_mega_moe_experts_weights`` leaves that the kernel reads.
PARAMETERS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")


def state(experts: nn.Module) -> dict[str, torch.Tensor]:
    return {**{n: getattr(experts, n) for n in PARAMETERS},
            **{f"mega_l{g}_weights[{i}]": getattr(experts, f"mega_l{g}_weights")[i] for g in (1, 2) for i in (0, 1)}}
