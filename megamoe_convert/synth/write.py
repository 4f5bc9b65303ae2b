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

from megamoe_convert.errors import SynthError
from megamoe_convert.output import preflight
from megamoe_convert.output.writer import write_json_atomic, write_safetensors
from megamoe_convert.source import families, formats
from megamoe_convert.source.checkpoint import CONFIG_NAME, INDEX_NAME
from megamoe_convert.source.formats import WeightFormat
from megamoe_convert.source.model_dims import MAX_LAYERS, check_dims
from megamoe_convert.source.safetensors_io import DTYPE_BITS
from megamoe_convert.synth import hf_moe
from megamoe_convert.synth.kimi import kimi_k3_tensors
from megamoe_convert.synth.presets import load_preset
from megamoe_convert.synth.tensors import (
    E4M3_SCALE_BYTE_RANGE,
    FAMILY_DTYPES,
    SCALE_BYTE_RANGE,
    SCALE_DTYPES,
    WEIGHT_DTYPES,
    SynthTensor,
    deepseek_tensors,
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
    if family in hf_moe.FAMILIES:
        yield from hf_moe.hf_moe_tensors(family, config, fmt, weight_dtype, scale_dtype)
        return
    yield from deepseek_tensors(family, config, fmt, weight_dtype, scale_dtype)


#: Bytes of one tensor generated at a time: a large tensor (a vocabulary's embedding, GBs) is made in
#: pieces, so that memory holds one piece and its float32 temporaries, never the whole tensor several
#: times over. A multiple of every element size; a tensor up to this size is made in one piece.
SYNTH_CHUNK_BYTES = 64 << 20


def _tensor_chunks(t: SynthTensor, rng: np.random.Generator) -> Iterator[bytes]:
    """The bytes of ``t``, in pieces of at most :data:`SYNTH_CHUNK_BYTES` (same seed, same bytes)."""
    for start in range(0, t.nbytes, SYNTH_CHUNK_BYTES):
        yield _fill_bytes(t, min(SYNTH_CHUNK_BYTES, t.nbytes - start), rng)


def _fill_bytes(t: SynthTensor, nbytes: int, rng: np.random.Generator) -> bytes:
    """``nbytes`` of ``t``'s kind of content (its ``fill``)."""
    if t.fill in ("scale", "e4m3_scale"):
        low, high = SCALE_BYTE_RANGE if t.fill == "scale" else E4M3_SCALE_BYTE_RANGE
        return rng.integers(low, high, size=nbytes, dtype=np.uint8).tobytes()
    if t.fill == "fp32_scale":  # positive, finite: 2**-12 .. 2**-4 with random mantissas, in the tensor's dtype
        values = rng.uniform(2.0 ** -12, 2.0 ** -4, size=nbytes * 8 // DTYPE_BITS[t.dtype]).astype(np.float32)
        if t.dtype == "BF16":  # the high halves of the float32 values
            return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        return values.astype(np.float16 if t.dtype == "F16" else np.float32).tobytes()
    if t.fill == "ones":
        return np.full(nbytes // 2, 0x3F80, dtype=np.uint16).tobytes()  # bf16 1.0
    if t.fill == "e4m3":  # every byte but the two NaNs (0x7F, 0xFF)
        codes = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        return np.where(codes & 0x7F == 0x7F, codes - 1, codes).astype(np.uint8).tobytes()
    if t.fill == "bf16":  # the high halves of small float32 values
        words = (rng.standard_normal(nbytes // 2, dtype=np.float32) * 0.05).view(np.uint32)
        return (words >> 16).astype(np.uint16).tobytes()
    if t.fill == "value":
        return np.full(nbytes // 4, t.value, dtype=np.float32).tobytes()
    return rng.bytes(nbytes)


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
    ``weight_dtype`` / ``scale_dtype`` pick among the dtypes MXFP4 checkpoints may use (and ``float32`` /
    ``bfloat16`` / ``float16`` the FP8 block scales of ``fp8_block`` releases).

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
    check_counts(text, keys, layers, experts, mtp_layers)
    fmt = formats.by_name(weight_format or family.weight_formats[0], "--format")
    if fmt.name not in family.weight_formats:
        raise SynthError(f"--format {fmt.name}: {family.title} checkpoints ship {'/'.join(family.weight_formats)} "
                         f"routed experts only; drop --format or pick a preset of another family")
    if scale_dtype is not None and SCALE_DTYPES[scale_dtype] not in fmt.scale_dtypes:
        allowed = [name for name, dtype in SCALE_DTYPES.items() if dtype in fmt.scale_dtypes]
        raise SynthError(f"--scale-dtype {scale_dtype}: {fmt.name} experts' scales are stored as "
                         f"{', '.join(allowed) or 'nothing (unscaled)'}")
    if layers is not None:
        text[keys["layers"]] = layers
        text["num_hash_layers"] = min(text.get("num_hash_layers", 0), layers)
    if experts is not None:
        text[keys["experts"]] = experts
        text[keys["top_k"]] = min(text[keys["top_k"]], experts)
    if mtp_layers is not None:
        text[keys["mtp_layers"]] = mtp_layers
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
    total = sum(t.nbytes for t in tensors)
    preflight.check_free_space(final, total, f"this {preset} checkpoint",
                               "free space, or cut it down with --layers / --experts", SynthError)
    out = final.with_name(f".{final.name}.partial")
    remove_own_folder(out)  # left by a killed run
    out.mkdir(parents=True)
    (out / OWN_MARKER).write_text("written by megamoe synth; removed when the run completes or reruns\n")
    try:
        _write_checkpoint(out, config, tensors, shards, seed, progress)
        _replace_dir(out, final)
    except BaseException:  # an error or Ctrl-C: nothing of this run stays behind (a SIGKILL's, the rerun removes)
        if (out / OWN_MARKER).is_file() and not out.is_symlink():
            shutil.rmtree(out, ignore_errors=True)
        raise
    return config


def _write_checkpoint(out: Path, config: dict[str, Any], tensors: list[SynthTensor], shards: list[list[SynthTensor]],
                      seed: int, progress: Any) -> None:
    if progress:
        progress.start(sum(t.nbytes for t in tensors), len(shards))
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        rng = np.random.default_rng([seed, number])
        chunks = (chunk for t in shard for chunk in _tensor_chunks(t, rng))
        write_safetensors(out / filename, out, [t.spec() for t in shard], _reporting(chunks, filename, progress),
                          metadata={"format": "pt"}, fsync=False)
        if progress:
            progress.advance(0, filename, False)
        weight_map.update({t.name: filename for t in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    write_json_atomic(out / INDEX_NAME, json.dumps(index, indent=2), fsync=False)
    write_json_atomic(out / CONFIG_NAME, json.dumps(config, indent=2), fsync=False)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192, "synthetic": True}))


#: Counted routed experts (layers x experts, MTP included) a synthetic checkpoint may hold: 3x the
#: largest preset (Kimi-K3: 93 x 896), so a typo cannot plan terabytes.
MAX_SYNTH_EXPERTS = 1 << 18
#: A hidden file inside ``synth``'s own temporary folders: only a folder holding it is ever removed.
OWN_MARKER = ".megamoe-synth"


def check_counts(text: dict[str, Any], keys: Any, layers: int | None, experts: int | None,
                 mtp_layers: int | None) -> None:
    """``--layers`` / ``--experts`` / ``--mtp-layers`` within what ``convert`` takes, and a bounded total."""
    for flag, value, lo, hi in (("--layers", layers, 1, MAX_LAYERS), ("--experts", experts, 1, MAX_SYNTH_EXPERTS),
                                ("--mtp-layers", mtp_layers, 0, MAX_LAYERS)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi):
            raise SynthError(f"{flag} {value}: expected a whole number in {lo}..{hi}")
    n_layers = (layers if layers is not None else text[keys["layers"]]) + \
        (mtp_layers if mtp_layers is not None else text.get(keys["mtp_layers"], 0))
    n_experts = experts if experts is not None else text[keys["experts"]]
    if n_layers * n_experts > MAX_SYNTH_EXPERTS:
        raise SynthError(f"{n_layers} MoE layers x {n_experts} experts = {n_layers * n_experts} routed experts, at "
                         f"most {MAX_SYNTH_EXPERTS} in one synthetic checkpoint; cut it down with --layers / --experts")


def remove_own_folder(path: Path) -> None:
    """Remove ``path`` if ``synth`` made it (a real folder holding :data:`OWN_MARKER`); refuse to
    touch anything else under the name."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir() or not (path / OWN_MARKER).is_file():
        raise SynthError(f"{path}: exists and was not made by megamoe synth; remove it or choose another name")
    shutil.rmtree(path)


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
    remove_own_folder(old)
    if final.exists():
        os.replace(final, old)
        (old / OWN_MARKER).touch()  # what --overwrite replaces is removed next, even after a kill here
    os.replace(new, final)
    (final / OWN_MARKER).unlink(missing_ok=True)
    shutil.rmtree(old, ignore_errors=True)


def _reporting(chunks: Iterator[bytes], filename: str, progress: Any) -> Iterator[bytes]:
    for chunk in chunks:
        yield chunk
        if progress:
            progress.advance(len(chunk), filename, False, files=0)
