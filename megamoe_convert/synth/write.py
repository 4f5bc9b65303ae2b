"""Synthetic checkpoints of every supported model family with random bytes, for tests, demos and benchmarks.

The files look like a released checkpoint where it matters to the converter: the family's real
tensor names (``families.py``; DeepSeek-V4's have no ``model.`` prefix and ``mtp.{k}.`` for MTP
blocks; Kimi-K3's are ``kimi.py``'s), routed experts of any MegaMoE
weight format (``formats.py``; DeepSeek-V4's is MXFP4: FP4 with ``float8_e8m0fnu`` 1x32 scales),
FP8 e4m3 linears and shared experts with 128x128 ``float8_e8m0fnu`` block scales (what
DeepSeek-V4's FP4 checkpoints ship: vLLM's ``is_scale_e8m0``; V4.1's are 32x32), and shards cut by size,
not by layer, so one layer's experts span several files. Generation streams tensor by
tensor: a checkpoint larger than memory can be written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from megamoe_convert.layout import check_dims
from megamoe_convert.output.writer import write_json_atomic, write_safetensors
from megamoe_convert.source import families, formats
from megamoe_convert.source.checkpoint import CONFIG_NAME, INDEX_NAME
from megamoe_convert.source.formats import WeightFormat
from megamoe_convert.synth.kimi import kimi_k3_tensors
from megamoe_convert.synth.tensors import (
    E4M3_SCALE_BYTE_RANGE,
    FAMILY_DTYPES,
    SCALE_BYTE_RANGE,
    SCALE_DTYPES,
    WEIGHT_DTYPES,
    SynthTensor,
    deepseek_tensors,
    load_preset,
)


def checkpoint_tensors(config: dict[str, Any], fmt: WeightFormat = formats.MXFP4, weight_dtype: str | None = None,
                       scale_dtype: str | None = None) -> Iterator[SynthTensor]:
    """Every tensor of the checkpoint, in release order (embedding, blocks, MTP, head), routed experts
    in ``fmt`` with the family's names; dtypes default to the family's (Kimi-K3: compressed-tensors'
    uint8) or the format's first (canonical) ones."""
    family = families.detect(config, "synth preset")
    weight_dtype = weight_dtype or FAMILY_DTYPES.get(family.name, {}).get("weight") or fmt.checkpoint_weight_dtypes[0]
    scale_dtype = scale_dtype or (FAMILY_DTYPES.get(family.name, {}).get("scale") or fmt.scale_dtypes[0]
                                  if fmt.scaled else "")
    if family is families.KIMI_K3:
        yield from kimi_k3_tensors(config, fmt, weight_dtype, scale_dtype)
        return
    yield from deepseek_tensors(family, config, fmt, weight_dtype, scale_dtype)


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
    """Write a random checkpoint of the preset's model family into ``out``; return its config.

    ``layers`` / ``experts`` / ``mtp_layers`` replace the preset's counts (in ``text_config`` for
    the families that nest them).

    ``weight_format`` (``formats.FORMATS``) replaces the preset's routed-expert format;
    ``weight_dtype`` / ``scale_dtype`` pick among the dtypes MXFP4 checkpoints may use.

    ``out`` must be new or empty (``overwrite``: it is replaced). The checkpoint is written
    into a hidden sibling folder and renamed into place when complete, so a crash never leaves
    something that reads as a checkpoint.

    ``progress`` (optional) gets ``start(total_bytes, total_files)`` once, then ``advance`` with
    ``files=0`` per chunk written and ``advance(0, filename, False)`` as each shard is finished.
    """
    config = json.loads(json.dumps(load_preset(preset)))  # a deep copy: overrides go into text_config
    family = families.detect(config, preset)
    text, keys = family.text(config), family.keys
    assert isinstance(text, dict)
    if layers is not None:
        text[keys["layers"]] = layers
        text["num_hash_layers"] = min(text.get("num_hash_layers", 0), layers)
    if experts is not None:
        text[keys["experts"]] = experts
        text[keys["top_k"]] = min(text[keys["top_k"]], experts)
    if mtp_layers is not None:
        text[keys["mtp_layers"]] = mtp_layers
    fmt = formats.by_name(weight_format or formats.MXFP4.name, "--format")
    check_dims(text[keys["hidden"]], text[keys["intermediate"]])
    tensors = list(checkpoint_tensors(config, fmt, weight_dtype and WEIGHT_DTYPES[weight_dtype],
                                      scale_dtype and SCALE_DTYPES[scale_dtype]))
    if shard_bytes is None:
        names = family.names(text[keys["layers"]])
        first = next((found[0] for t in tensors if (found := names.parse_expert(t.name))), None)
        head = f"{names.block(first)}.experts." if first else "-"
        layer_expert_bytes = sum(t.nbytes for t in tensors if t.name.startswith(head))
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
