"""Kimi-K3 and DeepSeek-V4.1 in vLLM 0.33's real classes on the CPU, loaded by vLLM's own code.

The model trees are vLLM's own classes down to the MegaMoE experts: Kimi-K3's
``KimiK3ForConditionalGeneration`` > ``KimiLinearForCausalLM`` > ``KimiLinearModel`` >
``layers[i].block_sparse_moe`` (``KimiMoE``) > ``DeepGemmMegaMoEExperts``, and DeepSeek-V4.1's
``DeepseekV41ForCausalLM`` > ``DeepseekV41LLMForCausalLM`` > ``DeepseekV4Model`` > ``layers[i].ffn``
(``DeepseekV4MoE``) > ``DeepGemmMegaMoEExperts``. Each experts module is built with the arguments
its model's ``__init__`` passes (``KimiMoE.__init__``, ``DeepseekV4MoE._init_mega_moe_experts``);
attention, dense MLPs and vision towers are left out (their constructors need a GPU). The configs
are vLLM's own config classes (``KimiK3Config``, ``DeepseekV41Config``) built from the
checkpoint's ``config.json``. Loading goes through vLLM's ``safetensors_weights_iterator``, the
top model's ``hf_to_vllm_mapper`` and ``load_weights`` down to the experts' ``weight_loader``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import types
from pathlib import Path
from typing import Iterator
from unittest import mock

from torch import nn
from trees import bare
from vllm_harness import checkpoint_weights, mega_py
from vllm_harness import patched as v4_patched

kimi_py = importlib.import_module("vllm.models.kimi_k3.nvidia.model")
v41_py = importlib.import_module("vllm.models.deepseek_v41.nvidia.model")
v41_vl_py = importlib.import_module("vllm.models.deepseek_v41.nvidia.vl_model")


@contextlib.contextmanager
def patched(ep_rank: int, ep_size: int) -> Iterator[None]:
    """The V4 harness's patches (EP group, SM100 check, TP=1) plus V4.1's own PP group."""
    pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1)
    with v4_patched(ep_rank, ep_size), mock.patch.object(v41_py, "get_pp_group", lambda: pp_group, create=True), \
            mock.patch.object(v41_py, "get_tensor_model_parallel_world_size", lambda: 1, create=True):
        yield


def raw_config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


# --------------------------------------------------------------------------------------
# Kimi-K3
# --------------------------------------------------------------------------------------

def kimi_config(ckpt: Path):
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

    raw = raw_config(ckpt)
    return KimiK3Config(text_config=raw["text_config"], vision_config=raw.get("vision_config"))


def kimi_experts(text, prefix: str, ep_rank: int, ep_size: int, **overrides) -> nn.Module:
    """``DeepGemmMegaMoEExperts`` with the arguments ``KimiMoE.__init__`` passes (no redundant
    experts, no ``num_logical_experts``, latent hidden size, SiTU, never a shared expert)."""
    from vllm.config import VllmConfig

    local = text.num_experts // ep_size
    kwargs = dict(num_experts=text.num_experts, num_local_experts=local, experts_start_idx=ep_rank * local,
                  top_k=text.num_experts_per_token, hidden_size=text.routed_expert_hidden_size,
                  intermediate_size=text.moe_intermediate_size,
                  activation=mega_py.MegaMoEActivation("situ", alpha=text.activation_situ_beta or 1.0,
                                                       beta=text.activation_situ_linear_beta or 0.0),
                  weight_format=mega_py.MEGA_MOE_MXFP4, prefix=prefix)
    kwargs.update(overrides)
    return mega_py.DeepGemmMegaMoEExperts(VllmConfig(), **kwargs)


def build_kimi(config, ep_rank: int, ep_size: int, **overrides) -> nn.Module:
    """The real tree down to each MoE layer's experts (``KimiDecoderLayer.is_moe_layer``'s rule)."""
    text = config.text_config
    layers = nn.ModuleList()
    for i in range(text.num_hidden_layers):
        layer = nn.Module()
        if i >= text.first_k_dense_replace and i % text.moe_layer_freq == 0:
            prefix = f"language_model.model.layers.{i}.block_sparse_moe"
            moe = bare(kimi_py.KimiMoE, use_mega_moe=True,
                       experts=kimi_experts(text, f"{prefix}.experts", ep_rank, ep_size, **overrides))
            layer.block_sparse_moe = moe
            layer.mlp = moe  # KimiDecoderLayer's alias
        layers.append(layer)
    model = bare(kimi_py.KimiLinearModel, config=text, layers=layers, start_layer=0, end_layer=text.num_hidden_layers)
    language_model = bare(kimi_py.KimiLinearForCausalLM, config=text, model=model)
    return bare(kimi_py.KimiK3ForConditionalGeneration, config=config, language_model=language_model)


# --------------------------------------------------------------------------------------
# DeepSeek-V4.1
# --------------------------------------------------------------------------------------

def v41_config(ckpt: Path):
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    raw = raw_config(ckpt)
    return DeepseekV41Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})


def v41_shared_mlp(config) -> nn.Module:
    """What ``DeepGemmMegaMoEExperts`` reads of the shared MLP a V4.1 layer offers it: FP8 e4m3
    ``gate_up_proj`` / ``down_proj`` weights with the checkpoint's 32x32 UE8M0 block scales as
    ``weight_scale`` (vLLM's linear method for ``weight_block_size: [32, 32]``)."""
    import torch

    h, s = config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
    block = config.quantization_config["weight_block_size"][0]

    def linear(n: int, k: int) -> nn.Module:
        return bare(nn.Module, weight=torch.zeros(n, k, dtype=torch.float8_e4m3fn),
                    weight_scale=torch.zeros(n // block, k // block, dtype=torch.float8_e8m0fnu))

    return bare(nn.Module, gate_up_proj=linear(2 * s, h), down_proj=linear(h, s))


def v41_experts(config, prefix: str, ep_rank: int, ep_size: int, redundant: int, fuse_shared: bool) -> nn.Module:
    """``DeepGemmMegaMoEExperts`` with the arguments V4's ``_init_mega_moe_experts`` passes (V4.1's
    ``DeepseekV4MoE`` is its subclass): redundant experts, ``num_logical_experts``, the shared MLP
    when fusion is on (TP=1, ``VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION`` unset)."""
    from vllm.config import VllmConfig

    n_physical = config.n_routed_experts + redundant
    local = n_physical // ep_size
    return mega_py.DeepGemmMegaMoEExperts(
        VllmConfig(), num_experts=n_physical, num_local_experts=local, experts_start_idx=ep_rank * local,
        num_logical_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
        weight_format=mega_py.MEGA_MOE_MXFP4,
        activation=mega_py.MegaMoEActivation("swiglu", clamp=float(config.swiglu_limit)),
        shared_experts=v41_shared_mlp(config) if fuse_shared else None, prefix=prefix)


def build_v41(config, ep_rank: int, ep_size: int, redundant: int, fuse_shared: bool = True) -> nn.Module:
    """``DeepseekV41ForCausalLM`` (the VL entry point V4.1 checkpoints declare) > ``DeepseekV41LLMForCausalLM``
    > ``DeepseekV4Model`` > ``layers[i].ffn`` (V4.1's ``DeepseekV4MoE``) > experts, with the mappers
    ``__init__`` makes (the outer one for a ``[32, 32]``-block checkpoint, the inner one a no-op)."""
    n = config.num_hidden_layers
    layers = nn.ModuleList()
    for i in range(n):
        experts = v41_experts(config, f"language_model.model.layers.{i}.ffn.experts", ep_rank, ep_size, redundant,
                              fuse_shared)
        block = nn.Module()
        block.ffn = bare(v41_py.DeepseekV4MoE, use_native_mega_moe=True, experts=experts,
                         shared_experts=None,
                         prefix=experts.prefix.removesuffix(".experts"))
        layers.append(block)
    model = bare(v41_py.DeepseekV4Model, config=config, quant_config=None, use_sequence_parallel=False,
                 start_layer=0, end_layer=n, layers=layers, vllm_config=types.SimpleNamespace(engram_config=None))
    language_model = bare(v41_py.DeepseekV41LLMForCausalLM, config=config, model=model,
                          hf_to_vllm_mapper=v41_py.WeightsMapper())
    mx_blocks = config.quantization_config.get("weight_block_size") == [32, 32]
    scale_name = "weight_scale" if mx_blocks else "weight_scale_inv"
    return bare(v41_vl_py.DeepseekV41ForCausalLM, config=config, language_model=language_model,
                hf_to_vllm_mapper=v41_vl_py._make_deepseek_v4_vl_weights_mapper(config.expert_dtype, scale_name))


# --------------------------------------------------------------------------------------
# vLLM's own loading
# --------------------------------------------------------------------------------------

def weights(ckpt: Path, shared: bool = False) -> Iterator:
    """vLLM's own iterator over the checkpoint: the routed experts (every family's ``.experts.``),
    with ``shared`` the shared experts too."""
    return ((name, t) for name, t in checkpoint_weights(ckpt, only_experts=False)
            if ".experts." in name or (shared and ".shared_experts." in name))


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    return {m.prefix: m for m in model.modules() if isinstance(m, mega_py.DeepGemmMegaMoEExperts)}


def build_v41_dspark(config, ep_rank: int, ep_size: int, redundant: int, fuse_shared: bool = False) -> nn.Module:
    """V4.1's DSpark draft (``DSparkDeepseekV4ForCausalLM`` > ``DSparkDeepseekV4Model`` >
    ``layers[i].ffn``), its blocks numbered after the target's layers, with
    ``dspark_n_routed_experts`` experts and top-k (``DeepseekV4MoE.__init__``) and the target's
    redundant experts (``_init_mega_moe_experts``); the linear scale name ``__init__`` picks for a
    ``[32, 32]``-block checkpoint with FP4 experts (``_linear_scale_param_name``)."""
    dspark_py = importlib.import_module("vllm.models.deepseek_v41.nvidia.dspark")
    n, experts = config.num_hidden_layers, config.dspark_n_routed_experts
    draft = types.SimpleNamespace(**{**vars(config), "n_routed_experts": experts,
                                     "num_experts_per_tok": config.dspark_num_experts_per_tok})
    layers = nn.ModuleList()
    for i in range(config.num_nextn_predict_layers):
        block = nn.Module()
        block.ffn = bare(v41_py.DeepseekV4MoE, use_native_mega_moe=True, shared_experts=None,
                         experts=v41_experts(draft, f"model.layers.{n + i}.ffn.experts", ep_rank, ep_size, redundant,
                                             fuse_shared))
        layers.append(block)
    model = bare(dspark_py.DSparkDeepseekV4Model, layers=layers, num_hidden_layers=n, confidence_head=None)
    scale_name = v41_py._linear_scale_param_name(
        types.SimpleNamespace(quant_config=types.SimpleNamespace(**config.quantization_config)), config.expert_dtype)
    return bare(dspark_py.DSparkDeepseekV4ForCausalLM, config=config, model=model, linear_scale_name=scale_name,
                pad_shared_expert=True)


def build_kimi_mtp(config, ep_rank: int, ep_size: int) -> nn.Module:
    """``KimiK3MTP`` > ``KimiK3MultiTokenPredictor`` > ``layers[str(N + i)]``
    (``KimiK3MultiTokenPredictorLayer``) > ``mtp_block`` (a ``KimiDecoderLayer`` prefixed
    ``model.layers.{N + i}``) > ``block_sparse_moe`` > experts."""
    mtp_py = importlib.import_module("vllm.models.kimi_k3.nvidia.mtp")
    text = config.text_config
    n = text.num_hidden_layers
    layers = nn.ModuleDict()
    for i in range(text.num_nextn_predict_layers):
        block = nn.Module()
        block.block_sparse_moe = bare(kimi_py.KimiMoE, use_mega_moe=True, experts=kimi_experts(
            text, f"model.layers.{n + i}.block_sparse_moe.experts", ep_rank, ep_size))
        block.mlp = block.block_sparse_moe
        layers[str(n + i)] = bare(mtp_py.KimiK3MultiTokenPredictorLayer, config=text, mtp_block=block)
    predictor = bare(mtp_py.KimiK3MultiTokenPredictor, config=text, layers=layers, mtp_start_layer_idx=n,
                     num_mtp_layers=text.num_nextn_predict_layers)
    return bare(mtp_py.KimiK3MTP, config=text, model=predictor)
