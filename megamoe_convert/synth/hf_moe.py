"""DeepSeek-V3/R1, Qwen3-MoE and GLM-4.5's tensors for ``synth``: the Hugging Face naming their FP8
releases ship (``model.layers.L.self_attn.*``, ``model.layers.L.mlp.*``).

What the releases hold: BF16 embeddings, norms, router (``mlp.gate.weight``, and DeepSeek-V3 /
GLM-4.5's ``e_score_correction_bias``) and head; FP8 e4m3 linears with FP32 128x128 block scales
(``weight_scale_inv``) for attention, the dense layers' MLP, the shared expert and the routed
experts (``mlp.experts.E.{gate,up,down}_proj``). DeepSeek-V3 and GLM-4.5 number their one MTP layer
after the decoder layers, with ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` beside
it. Attention is cut down to a few tensors per layer: the converter copies every non-expert tensor
verbatim, whatever it is.
"""

from __future__ import annotations

from typing import Any, Iterator

from megamoe_convert.source import families
from megamoe_convert.source.formats import WeightFormat
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.synth.tensors import FP8_BLOCK, SynthTensor, expert_tensors

#: The families whose checkpoints this module writes.
FAMILIES = (families.DEEPSEEK_V3, families.QWEN3_MOE, families.GLM4_MOE)


def _fp8_linear(name: str, n: int, k: int) -> Iterator[SynthTensor]:
    """An FP8 e4m3 ``[n, k]`` linear with FP32 128x128 block scales (``weight_scale_inv``)."""
    yield SynthTensor(f"{name}.weight", "F8_E4M3", (n, k), "e4m3")
    yield SynthTensor(f"{name}.weight_scale_inv", "F32", (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), "fp32_scale")


def _mlp(prefix: str, hidden: int, inter: int) -> Iterator[SynthTensor]:
    """A gated FP8 MLP: the dense layers' ``mlp`` and the MoE layers' ``shared_experts``."""
    yield from _fp8_linear(f"{prefix}.gate_proj", inter, hidden)
    yield from _fp8_linear(f"{prefix}.up_proj", inter, hidden)
    yield from _fp8_linear(f"{prefix}.down_proj", hidden, inter)


def _query_width(text: dict[str, Any]) -> int:
    """The query projection's rows: heads x ``head_dim`` where the config names one (Qwen3-MoE and
    GLM-4.5's 64 or 96 heads of 128 outgrow the hidden size, and an engine's model shards those rows
    over its tensor-parallel ranks), else the hidden size (DeepSeek-V3's MLA, written as one stand-in)."""
    if "head_dim" not in text:
        return text["hidden_size"]
    return text["num_attention_heads"] * text["head_dim"]


def _layer(family: families.ModelFamily, index: int, text: dict[str, Any], moe: bool) -> Iterator[SynthTensor]:
    """One decoder layer's tensors but the routed experts."""
    h, p = text["hidden_size"], f"model.layers.{index}"
    yield SynthTensor(f"{p}.input_layernorm.weight", "BF16", (h,), "ones")
    yield SynthTensor(f"{p}.post_attention_layernorm.weight", "BF16", (h,), "ones")
    yield from _fp8_linear(f"{p}.self_attn.q_proj", _query_width(text), h)
    yield from _fp8_linear(f"{p}.self_attn.o_proj", h, _query_width(text))
    if not moe:
        yield from _mlp(f"{p}.mlp", h, text["intermediate_size"])
        return
    experts = text[family.keys["experts"]]
    yield SynthTensor(f"{p}.mlp.gate.weight", "BF16", (experts, h), "bf16")
    if family is not families.QWEN3_MOE:  # noaux_tc routing's bias, and one shared expert
        yield SynthTensor(f"{p}.mlp.gate.e_score_correction_bias", "F32", (experts,), "value")
        yield from _mlp(f"{p}.mlp.shared_experts", h, text["moe_intermediate_size"] * text.get("n_shared_experts", 1))


def hf_moe_tensors(family: families.ModelFamily, config: dict[str, Any], fmt: WeightFormat, weight_dtype: str,
                   scale_dtype: str) -> Iterator[SynthTensor]:
    """Every tensor, in release order: embedding, decoder layers, MTP layers (numbered after them), head."""
    text = dict(family.text(config))
    n, h = text[family.keys["layers"]], text["hidden_size"]
    names = family.names(n)
    first_dense = text.get(family.first_dense_key, 0) if family.first_dense_key else 0
    freq = text.get(family.freq_key, 1) if family.freq_key else 1
    moe_layers = set(family.moe_layer_indices(n, first_dense, freq))
    expert_args = (text[family.keys["experts"]], h, text[family.keys["intermediate"]], fmt, weight_dtype, scale_dtype)
    yield SynthTensor("model.embed_tokens.weight", "BF16", (text["vocab_size"], h), "bf16")
    for index in range(n):
        yield from _layer(family, index, text, index in moe_layers)
        if index in moe_layers:
            yield from expert_tensors(names, MoELayer(False, index), *expert_args)
    for k in range(text.get(family.keys["mtp_layers"], 0)):
        p = f"model.layers.{n + k}"
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            yield SynthTensor(f"{p}.{norm}.weight", "BF16", (h,), "ones")
        yield SynthTensor(f"{p}.eh_proj.weight", "BF16", (h, 2 * h), "bf16")
        yield from _layer(family, n + k, text, True)
        yield from expert_tensors(names, MoELayer(True, k), *expert_args)
    yield SynthTensor("model.norm.weight", "BF16", (h,), "ones")
    yield SynthTensor("lm_head.weight", "BF16", (text["vocab_size"], h), "bf16")
