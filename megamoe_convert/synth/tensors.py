"""The tensors of a synthetic checkpoint: names, dtypes and shapes as the releases ship them (DeepSeek-V4
and V4.1 here; Kimi-K3 in ``kimi.py``), with how each is filled. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from megamoe_convert.source import formats
from megamoe_convert.source.families import ModelFamily, TensorNames
from megamoe_convert.source.formats import WeightFormat
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import DTYPE_BITS, TensorSpec

#: Realistic UE8M0 exponents: 2**-17 .. 2**8, so dequantised values stay finite in bf16.
SCALE_BYTE_RANGE = (110, 136)
#: Positive E4M3 block scales 2**-2 .. 2**3 (NVFP4).
E4M3_SCALE_BYTE_RANGE = (0x28, 0x58)
#: FP8 linear block size (weights and scales of attention and shared experts).
FP8_BLOCK = 128

WEIGHT_DTYPES = {"int8": "I8", "uint8": "U8", "float4": "F4"}
SCALE_DTYPES = {"e8m0": "F8_E8M0", "uint8": "U8", "float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class SynthTensor:
    """One tensor to generate: name, dtype, logical shape, and how its bytes are drawn."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    #: "random" bytes, "scale" (UE8M0 bytes in SCALE_BYTE_RANGE), "e4m3_scale", "fp32_scale" (positive
    #: block scales, in the tensor's float dtype), "e4m3" (finite FP8 values), "bf16" (small finite
    #: values), "ones" (bf16 1.0), or "value" (F32 ``value``).
    fill: str = "random"
    value: float = 0.0

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return (numel * DTYPE_BITS[self.dtype] + 7) // 8

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape, self.nbytes)


#: How each checkpoint weight / scale dtype is filled.
WEIGHT_FILLS = {"F8_E4M3": "e4m3", "BF16": "bf16"}
SCALE_FILLS = {"F8_E4M3": "e4m3_scale", "F32": "fp32_scale", "BF16": "fp32_scale", "F16": "fp32_scale"}


def expert_tensors(names: TensorNames, layer: MoELayer, experts: int, hidden: int, inter: int, fmt: WeightFormat,
                   weight_dtype: str, scale_dtype: str) -> Iterator[SynthTensor]:
    """One layer's routed experts in ``fmt`` with the family's names (NVFP4: w1 and w3 share their
    global scale)."""
    shapes = formats.expert_matrix_shapes(hidden, inter)
    for e in range(experts):
        for proj in ("w1", "w2", "w3"):
            n, k = shapes[proj]
            cols = k if weight_dtype == "F4" else fmt.weight_row_bytes(k) * 8 // DTYPE_BITS[weight_dtype]
            yield SynthTensor(names.expert(layer, e, proj, "weight"), weight_dtype, (n, cols),
                              WEIGHT_FILLS.get(weight_dtype, "random"))
            if fmt.scaled:
                rows, blocks = fmt.scale_shape(n, k)  # FP32-encoded scales: one value per block, whatever its dtype
                cols = blocks if fmt.scale_encoding == "fp32" else \
                    blocks * fmt.scale_bytes * 8 // DTYPE_BITS[scale_dtype]
                yield SynthTensor(names.expert(layer, e, proj, "scale"), scale_dtype, (rows, cols),
                                  SCALE_FILLS.get(scale_dtype, "scale"))
            if fmt.global_scales:
                yield SynthTensor(names.expert(layer, e, proj, "weight_scale_2"), "F32", (), "value",
                                  1 / (1 + e % 7) if proj != "w2" else 1 / (2 + e % 5))
                if proj == "w2":
                    yield SynthTensor(names.expert(layer, e, proj, "input_scale"), "F32", (), "value", 0.5 + e % 9 / 8)


def _fp8_linear(name: str, n: int, k: int, block: int = FP8_BLOCK) -> Iterator[SynthTensor]:
    """An FP8 e4m3 ``[n, k]`` linear with ``block`` x ``block`` UE8M0 block scales."""
    yield SynthTensor(f"{name}.weight", "F8_E4M3", (n, k), "e4m3")
    yield SynthTensor(f"{name}.scale", "F8_E8M0", (-(-n // block), -(-k // block)), "scale")


def _block_tensors(key: str, layer_index: int, config: Mapping[str, Any], is_mtp: bool,
                   block: int = FP8_BLOCK) -> Iterator[SynthTensor]:
    """Non-expert tensors of one DeepSeek block: norms, attention, router, FP8 shared experts
    (``config``: the text model's fields)."""
    h, i = config["hidden_size"], config["moe_intermediate_size"]
    q_lora, kv = config.get("q_lora_rank", 128), config.get("head_dim", 128)
    yield SynthTensor(f"{key}.attn_norm.weight", "BF16", (h,), "ones")
    yield from _fp8_linear(f"{key}.attn.wq_a", q_lora, h, block)
    yield from _fp8_linear(f"{key}.attn.wkv", kv, h, block)
    yield SynthTensor(f"{key}.attn.wo.weight", "BF16", (h, kv))
    yield SynthTensor(f"{key}.ffn_norm.weight", "BF16", (h,), "ones")
    n_routed = config["dspark_n_routed_experts"] if is_mtp and config.get("dspark_n_routed_experts") \
        else config["n_routed_experts"]
    if not is_mtp and layer_index < config.get("num_hash_layers", 0):
        yield SynthTensor(f"{key}.ffn.gate.tid2eid", "I32", (config["vocab_size"], config["num_experts_per_tok"]))
    else:
        yield SynthTensor(f"{key}.ffn.gate.weight", "BF16", (n_routed, h))
        yield SynthTensor(f"{key}.ffn.gate.bias", "F32", (n_routed,))
    shared_i = i * config.get("n_shared_experts", 1)
    for proj, (n, k) in (("w1", (shared_i, h)), ("w2", (h, shared_i)), ("w3", (shared_i, h))):
        yield from _fp8_linear(f"{key}.ffn.shared_experts.{proj}", n, k, block)


#: Expert dtypes a family's releases store (the default for ``synth``).
FAMILY_DTYPES = {"kimi_k3": {"weight": "U8", "scale": "U8"}}


def deepseek_tensors(family: ModelFamily, config: dict[str, Any], fmt: WeightFormat, weight_dtype: str,
                      scale_dtype: str) -> Iterator[SynthTensor]:
    """DeepSeek-V4 and V4.1: the same names; V4.1's sizes under ``text_config``, 32x32 FP8 blocks
    (``quantization_config.weight_block_size``) and DSpark MTP blocks with their own expert count."""
    text = family.text(config)
    h, n_layers = text["hidden_size"], text["num_hidden_layers"]
    block = ((config.get("quantization_config") or {}).get("weight_block_size") or [FP8_BLOCK])[0]
    names = family.names(n_layers)
    expert_args = (text["hidden_size"], text["moe_intermediate_size"], fmt, weight_dtype, scale_dtype)
    yield SynthTensor("embed.weight", "BF16", (text["vocab_size"], h))
    for index in range(n_layers):
        yield from _block_tensors(f"layers.{index}", index, text, False, block)
        yield from expert_tensors(names, MoELayer(False, index), text["n_routed_experts"], *expert_args)
    for index in range(text.get("num_nextn_predict_layers", 0)):
        key = f"mtp.{index}"
        yield SynthTensor(f"{key}.e_proj.weight", "BF16", (h, h))
        yield SynthTensor(f"{key}.h_proj.weight", "BF16", (h, h))
        yield SynthTensor(f"{key}.enorm.weight", "BF16", (h,), "ones")
        yield SynthTensor(f"{key}.hnorm.weight", "BF16", (h,), "ones")
        yield from _block_tensors(key, index, text, True, block)
        experts = text.get("dspark_n_routed_experts") or text["n_routed_experts"]
        yield from expert_tensors(names, MoELayer(True, index), experts, *expert_args)
    yield SynthTensor("norm.weight", "BF16", (h,), "ones")
    yield SynthTensor("head.weight", "BF16", (text["vocab_size"], h))


