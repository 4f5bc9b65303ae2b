"""Synthetic DeepSeek-V4-format checkpoints with random bytes, for tests, demos and benchmarks.

The files look like a released checkpoint where it matters to the converter: the real
tensor names (no ``model.`` prefix, ``mtp.{k}.`` for MTP blocks), routed experts of any MegaMoE
weight format (``formats.py``; DeepSeek-V4's is MXFP4: FP4 with ``float8_e8m0fnu`` 1x32 scales),
FP8 e4m3 linears and shared experts with 128x128 ``float8_e8m0fnu`` block scales (what
DeepSeek-V4's FP4 checkpoints ship: vLLM's ``is_scale_e8m0``), and shards cut by size,
not by layer, so one layer's experts span several files. Generation streams tensor by
tensor: a checkpoint larger than memory can be written.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .checkpoint import CONFIG_NAME, INDEX_NAME, MoELayer
from . import formats
from .formats import WeightFormat
from .layout import check_dims
from .safetensors_io import DTYPE_BITS, TensorSpec
from .writer import write_json_atomic, write_safetensors

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
PRESETS = ("tiny", "flash", "pro")

#: Realistic UE8M0 exponents: 2**-17 .. 2**8, so dequantised values stay finite in bf16.
SCALE_BYTE_RANGE = (110, 136)
#: Positive E4M3 block scales 2**-2 .. 2**3 (NVFP4).
E4M3_SCALE_BYTE_RANGE = (0x28, 0x58)
#: FP8 linear block size (weights and scales of attention and shared experts).
FP8_BLOCK = 128

WEIGHT_DTYPES = {"int8": "I8", "uint8": "U8", "float4": "F4"}
SCALE_DTYPES = {"e8m0": "F8_E8M0", "uint8": "U8"}


def load_preset(name: str) -> dict[str, Any]:
    """A preset's ``config.json`` fields, from ``configs/{name}.json`` (or a path to a JSON file)."""
    path = Path(name) if name.endswith(".json") else CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}: no {path} (presets: {', '.join(PRESETS)})")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class SynthTensor:
    """One tensor to generate: name, dtype, logical shape, and how its bytes are drawn."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    #: "random" bytes, "scale" (UE8M0 bytes in SCALE_BYTE_RANGE), "e4m3_scale", "e4m3" (finite
    #: FP8 values), "bf16" (small finite values), "ones" (bf16 1.0), or "value" (F32 ``value``).
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
SCALE_FILLS = {"F8_E4M3": "e4m3_scale"}


def _expert_tensors(layer: MoELayer, config: dict[str, Any], fmt: WeightFormat, weight_dtype: str,
                    scale_dtype: str) -> Iterator[SynthTensor]:
    """One layer's routed experts in ``fmt`` (NVFP4: w1 and w3 share their global scale)."""
    shapes = formats.expert_matrix_shapes(config["hidden_size"], config["moe_intermediate_size"])
    for e in range(config["n_routed_experts"]):
        for proj in ("w1", "w2", "w3"):
            n, k = shapes[proj]
            cols = k if weight_dtype == "F4" else fmt.weight_row_bytes(k) * 8 // DTYPE_BITS[weight_dtype]
            yield SynthTensor(layer.tensor_name(e, proj, "weight"), weight_dtype, (n, cols),
                              WEIGHT_FILLS.get(weight_dtype, "random"))
            if fmt.scaled:
                yield SynthTensor(layer.tensor_name(e, proj, "scale"), scale_dtype, (n, fmt.scale_row_bytes(k)),
                                  SCALE_FILLS.get(scale_dtype, "scale"))
            if fmt.global_scales:
                yield SynthTensor(layer.tensor_name(e, proj, "weight_scale_2"), "F32", (), "value",
                                  1 / (1 + e % 7) if proj != "w2" else 1 / (2 + e % 5))
                if proj == "w2":
                    yield SynthTensor(layer.tensor_name(e, proj, "input_scale"), "F32", (), "value", 0.5 + e % 9 / 8)


def _fp8_linear(name: str, n: int, k: int) -> Iterator[SynthTensor]:
    """An FP8 e4m3 ``[n, k]`` linear with 128x128 UE8M0 block scales."""
    yield SynthTensor(f"{name}.weight", "F8_E4M3", (n, k), "e4m3")
    yield SynthTensor(f"{name}.scale", "F8_E8M0", (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), "scale")


def _block_tensors(key: str, layer_index: int, config: dict[str, Any], is_mtp: bool) -> Iterator[SynthTensor]:
    """Non-expert tensors of one block: norms, attention, router, FP8 shared experts."""
    h, i = config["hidden_size"], config["moe_intermediate_size"]
    q_lora, kv = config.get("q_lora_rank", 128), config.get("head_dim", 128)
    yield SynthTensor(f"{key}.attn_norm.weight", "BF16", (h,), "ones")
    yield from _fp8_linear(f"{key}.attn.wq_a", q_lora, h)
    yield from _fp8_linear(f"{key}.attn.wkv", kv, h)
    yield SynthTensor(f"{key}.attn.wo.weight", "BF16", (h, kv))
    yield SynthTensor(f"{key}.ffn_norm.weight", "BF16", (h,), "ones")
    n_routed = config["n_routed_experts"]
    if not is_mtp and layer_index < config.get("num_hash_layers", 0):
        yield SynthTensor(f"{key}.ffn.gate.tid2eid", "I32", (config["vocab_size"], config["num_experts_per_tok"]))
    else:
        yield SynthTensor(f"{key}.ffn.gate.weight", "BF16", (n_routed, h))
        yield SynthTensor(f"{key}.ffn.gate.bias", "F32", (n_routed,))
    shared_i = i * config.get("n_shared_experts", 1)
    for proj, (n, k) in (("w1", (shared_i, h)), ("w2", (h, shared_i)), ("w3", (shared_i, h))):
        yield from _fp8_linear(f"{key}.ffn.shared_experts.{proj}", n, k)


def checkpoint_tensors(config: dict[str, Any], fmt: WeightFormat = formats.MXFP4, weight_dtype: str | None = None,
                       scale_dtype: str | None = None) -> Iterator[SynthTensor]:
    """Every tensor of the checkpoint, in release order (embedding, blocks, MTP, head), routed experts
    in ``fmt``; dtypes default to the format's first (canonical) ones."""
    h = config["hidden_size"]
    weight_dtype = weight_dtype or fmt.checkpoint_weight_dtypes[0]
    scale_dtype = scale_dtype or (fmt.scale_dtypes[0] if fmt.scaled else "")
    yield SynthTensor("embed.weight", "BF16", (config["vocab_size"], h))
    for index in range(config["num_hidden_layers"]):
        yield from _block_tensors(f"layers.{index}", index, config, is_mtp=False)
        yield from _expert_tensors(MoELayer(False, index), config, fmt, weight_dtype, scale_dtype)
    for index in range(config.get("num_nextn_predict_layers", 0)):
        key = f"mtp.{index}"
        yield SynthTensor(f"{key}.e_proj.weight", "BF16", (h, h))
        yield SynthTensor(f"{key}.h_proj.weight", "BF16", (h, h))
        yield SynthTensor(f"{key}.enorm.weight", "BF16", (h,), "ones")
        yield SynthTensor(f"{key}.hnorm.weight", "BF16", (h,), "ones")
        yield from _block_tensors(key, index, config, is_mtp=True)
        yield from _expert_tensors(MoELayer(True, index), config, fmt, weight_dtype, scale_dtype)
    yield SynthTensor("norm.weight", "BF16", (h,), "ones")
    yield SynthTensor("head.weight", "BF16", (config["vocab_size"], h))


def _tensor_bytes(t: SynthTensor, rng: np.random.Generator) -> bytes:
    if t.fill in ("scale", "e4m3_scale"):
        low, high = SCALE_BYTE_RANGE if t.fill == "scale" else E4M3_SCALE_BYTE_RANGE
        return rng.integers(low, high, size=t.nbytes, dtype=np.uint8).tobytes()
    if t.fill == "ones":
        return np.full(t.nbytes // 2, 0x3F80, dtype=np.uint16).tobytes()  # bf16 1.0
    if t.fill == "e4m3":  # every byte but the two NaNs (0x7F, 0xFF)
        values = rng.integers(0, 256, size=t.nbytes, dtype=np.uint8)
        return np.where(values & 0x7F == 0x7F, values - 1, values).astype(np.uint8).tobytes()
    if t.fill == "bf16":  # the high halves of small float32 values
        values = (rng.standard_normal(t.nbytes // 2, dtype=np.float32) * 0.05).view(np.uint32)
        return (values >> 16).astype(np.uint16).tobytes()
    if t.fill == "value":
        return np.full(t.nbytes // 4, t.value, dtype=np.float32).tobytes()
    return rng.bytes(t.nbytes)


def _shards(tensors: list[SynthTensor], shard_bytes: int) -> list[list[SynthTensor]]:
    """Cut the tensor sequence by size (as releases do), never by layer."""
    shards: list[list[SynthTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def synthesize(out: Path, preset: str = "tiny", *, layers: int | None = None, experts: int | None = None,
               mtp_layers: int | None = None, seed: int = 0, weight_dtype: str | None = None,
               scale_dtype: str | None = None, weight_format: str | None = None,
               shard_bytes: int | None = None, progress: Any = None, overwrite: bool = False) -> dict[str, Any]:
    """Write a random DeepSeek-V4-format checkpoint into ``out``; return its config.

    ``weight_format`` (``formats.FORMATS``) replaces the preset's routed-expert format;
    ``weight_dtype`` / ``scale_dtype`` pick among the dtypes MXFP4 checkpoints may use.

    ``out`` must be new or empty (``overwrite``: it is replaced). The checkpoint is written
    into a hidden sibling folder and renamed into place when complete, so a crash never leaves
    something that reads as a checkpoint.

    ``progress`` (optional) gets ``start(total_bytes, total_files)`` once, then ``advance`` with
    ``files=0`` per chunk written and ``advance(0, filename, False)`` as each shard is finished.
    """
    config = dict(load_preset(preset))
    if layers is not None:
        config["num_hidden_layers"] = layers
        config["num_hash_layers"] = min(config.get("num_hash_layers", 0), layers)
    if experts is not None:
        config["n_routed_experts"] = experts
        config["num_experts_per_tok"] = min(config["num_experts_per_tok"], experts)
    if mtp_layers is not None:
        config["num_nextn_predict_layers"] = mtp_layers
    fmt = formats.by_name(weight_format or formats.MXFP4.name, "--format")
    check_dims(config["hidden_size"], config["moe_intermediate_size"])
    tensors = list(checkpoint_tensors(config, fmt, weight_dtype and WEIGHT_DTYPES[weight_dtype],
                                      scale_dtype and SCALE_DTYPES[scale_dtype]))
    if shard_bytes is None:
        layer_expert_bytes = sum(t.nbytes for t in tensors if t.name.startswith("layers.0.ffn.experts."))
        shard_bytes = max(64 << 10, int(layer_expert_bytes * 0.4))
    shards = _shards(tensors, shard_bytes)
    final = Path(os.path.abspath(out))
    _check_synth_target(final, overwrite)
    out = final.with_name(f".{final.name}.partial")
    shutil.rmtree(out, ignore_errors=True)  # left by a crashed run
    out.mkdir(parents=True)
    if progress:
        progress.start(sum(t.nbytes for t in tensors), len(shards))
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        rng = np.random.default_rng([seed, number])
        chunks = (_tensor_bytes(t, rng) for t in shard)
        write_safetensors(out / filename, out, [t.spec() for t in shard], _reporting(chunks, filename, progress),
                          metadata={"format": "pt"}, fsync=False)
        if progress:
            progress.advance(0, filename, False)
        weight_map.update({t.name: filename for t in shard})
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json_atomic(out / INDEX_NAME, json.dumps(index, indent=2), fsync=False)
    write_json_atomic(out / CONFIG_NAME, json.dumps(config, indent=2), fsync=False)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192, "synthetic": True}))
    _replace_dir(out, final)
    return config


class SynthError(ValueError):
    """An output folder ``synth`` must not write into."""


def _check_synth_target(out: Path, overwrite: bool) -> None:
    """A new or empty directory (``overwrite``: any), other than ``/`` and the working directory,
    which is written beside and renamed into place."""
    cwd = Path.cwd().resolve()
    if not out.name or out.resolve() == cwd or out.resolve() in cwd.parents:
        raise SynthError(f"{out}: cannot replace the current directory or one above it; name a new directory")
    if out.exists() and not out.is_dir():
        raise SynthError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise SynthError(f"{out}: directory is not empty; choose a new one, or pass --overwrite to replace it")


def _replace_dir(new: Path, final: Path) -> None:
    """Rename ``new`` to ``final``; an existing ``final`` is moved aside first and then removed."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def _reporting(chunks: Iterator[bytes], filename: str, progress: Any) -> Iterator[bytes]:
    for chunk in chunks:
        yield chunk
        if progress:
            progress.advance(len(chunk), filename, False, files=0)
