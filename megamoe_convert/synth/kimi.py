"""Kimi-K3's tensors for ``synth``: the names and dtypes of moonshotai/Kimi-K3's checkpoint.

What the release holds (``language_model.`` text model, ``vision_tower.`` / ``mm_projector.``
beside it): BF16 attention, norms and dense MLP (layer 0), and per MoE layer a BF16 router with
its correction bias, the latent projections (``routed_expert_down_proj`` / ``_up_proj`` /
``_norm``: the routed experts run at ``routed_expert_hidden_size``), BF16 shared experts
(``gate_proj`` / ``up_proj`` / ``down_proj``), and compressed-tensors MXFP4 routed experts
(``weight_packed`` / ``weight_scale``, both uint8). Attention is cut down to a few tensors per
layer: the converter copies every non-expert tensor verbatim, whatever it is.
"""

from __future__ import annotations

from typing import Any, Iterator

from megamoe_convert.source import families
from megamoe_convert.source.formats import WeightFormat
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.synth.tensors import SynthTensor, expert_tensors

ROOT = "language_model.model"


def _mlp(prefix: str, hidden: int, inter: int) -> Iterator[SynthTensor]:
    """A BF16 gated MLP: the dense layers' ``mlp`` and the MoE layers' shared experts."""
    yield SynthTensor(f"{prefix}.gate_proj.weight", "BF16", (inter, hidden), "bf16")
    yield SynthTensor(f"{prefix}.up_proj.weight", "BF16", (inter, hidden), "bf16")
    yield SynthTensor(f"{prefix}.down_proj.weight", "BF16", (hidden, inter), "bf16")


def _layer(index: int, text: dict[str, Any], moe: bool) -> Iterator[SynthTensor]:
    """One decoder layer's non-routed tensors."""
    h, latent, i = text["hidden_size"], text["routed_expert_hidden_size"], text["moe_intermediate_size"]
    p = f"{ROOT}.layers.{index}"
    yield SynthTensor(f"{p}.input_layernorm.weight", "BF16", (h,), "ones")
    yield SynthTensor(f"{p}.post_attention_layernorm.weight", "BF16", (h,), "ones")
    yield SynthTensor(f"{p}.self_attn.g_proj.weight", "BF16", (h, h), "bf16")
    yield SynthTensor(f"{p}.self_attn.o_proj.weight", "BF16", (h, h), "bf16")
    if not moe:
        yield from _mlp(f"{p}.mlp", h, text["intermediate_size"])
        return
    b, e = f"{p}.block_sparse_moe", text["num_experts"]
    yield SynthTensor(f"{b}.gate.weight", "BF16", (e, h), "bf16")
    yield SynthTensor(f"{b}.gate.e_score_correction_bias", "F32", (e,), "value")
    yield SynthTensor(f"{b}.routed_expert_down_proj.weight", "BF16", (latent, h), "bf16")
    yield SynthTensor(f"{b}.routed_expert_norm.weight", "BF16", (latent,), "ones")
    yield SynthTensor(f"{b}.routed_expert_up_proj.weight", "BF16", (h, latent), "bf16")
    yield from _mlp(f"{b}.shared_experts", h, i * text.get("num_shared_experts", 1))


def kimi_k3_tensors(config: dict[str, Any], fmt: WeightFormat, weight_dtype: str,
                    scale_dtype: str) -> Iterator[SynthTensor]:
    """Every tensor, in release order: text model (MTP blocks numbered after the decoder layers),
    head, then the vision tower and projector."""
    family = families.KIMI_K3
    text = dict(family.text(config))
    n, h = text["num_hidden_layers"], text["hidden_size"]
    names = family.names(n)
    moe_layers = set(family.moe_layer_indices(n, text.get("first_k_dense_replace", 0), text.get("moe_layer_freq", 1)))
    expert_args = (text["num_experts"], text["routed_expert_hidden_size"], text["moe_intermediate_size"], fmt,
                   weight_dtype, scale_dtype)
    yield SynthTensor(f"{ROOT}.embed_tokens.weight", "BF16", (text["vocab_size"], h), "bf16")
    for index in range(n):
        yield from _layer(index, text, index in moe_layers)
        if index in moe_layers:
            yield from expert_tensors(names, MoELayer(False, index), *expert_args)
    for k in range(text.get("num_nextn_predict_layers", 0)):
        p = f"{ROOT}.layers.{n + k}"
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            yield SynthTensor(f"{p}.{norm}.weight", "BF16", (h,), "ones")
        yield SynthTensor(f"{p}.eh_proj.weight", "BF16", (h, 2 * h), "bf16")
        yield from _layer(n + k, text, True)
        yield from expert_tensors(names, MoELayer(True, k), *expert_args)
    yield SynthTensor(f"{ROOT}.norm.weight", "BF16", (h,), "ones")
    yield SynthTensor("language_model.lm_head.weight", "BF16", (text["vocab_size"], h), "bf16")
    vision = config.get("vision_config") or {}
    vt = vision.get("vt_hidden_size", 1024)
    yield SynthTensor("vision_tower.patch_embed.proj.weight", "BF16", (vt, 3, 14, 14), "bf16")
    yield SynthTensor("mm_projector.proj.2.weight", "BF16", (h, vision.get("mm_hidden_size", vt) * 4), "bf16")
