"""Synthetic checkpoints of every supported model family with random bytes, for tests, demos and benchmarks.

The files look like a released checkpoint where it matters to the converter: the family's real
tensor names (``families.py``; DeepSeek-V4's have no ``model.`` prefix and ``mtp.{k}.`` for MTP
blocks; Kimi-K3's are ``synth_kimi.py``'s), routed experts of any MegaMoE
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from . import families, formats, jsonio, preflight
from .checkpoint import CONFIG_NAME, INDEX_NAME, MAX_LAYERS, MoELayer
from .families import ModelFamily, TensorNames
from .formats import WeightFormat
from .layout import check_dims
from .safetensors_io import DTYPE_BITS, TensorSpec
from .writer import write_json_atomic, write_safetensors

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
#: DeepSeek-V4 (tiny, and the published Flash / Pro dims), DeepSeek-V4.1 (v4.1-flash: the published
#: V4.1-Flash dims), Kimi-K3 (the published dims): see README "Presets".
PRESETS = ("tiny", "flash", "pro", "v4.1-tiny", "v4.1-flash", "kimi-k3-tiny", "kimi-k3")

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
    return jsonio.read(path, SynthError, "preset", jsonio.MAX_CONFIG_BYTES)


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
                yield SynthTensor(names.expert(layer, e, proj, "scale"), scale_dtype, (n, fmt.scale_row_bytes(k)),
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


def _block_tensors(key: str, layer_index: int, config: dict[str, Any], is_mtp: bool,
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
        from .synth_kimi import kimi_k3_tensors

        yield from kimi_k3_tensors(config, fmt, weight_dtype, scale_dtype)
        return
    yield from _deepseek_tensors(family, config, fmt, weight_dtype, scale_dtype)


#: Expert dtypes a family's releases store (the default for ``synth``).
FAMILY_DTYPES = {"kimi_k3": {"weight": "U8", "scale": "U8"}}


def _deepseek_tensors(family: ModelFamily, config: dict[str, Any], fmt: WeightFormat, weight_dtype: str,
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
    check_counts(text, keys, layers, experts, mtp_layers)
    fmt = formats.by_name(weight_format or formats.MXFP4.name, "--format")
    if fmt.name not in family.weight_formats:
        raise SynthError(f"--format {fmt.name}: {family.title} checkpoints ship {'/'.join(family.weight_formats)} "
                         f"routed experts only; drop --format or pick a preset of another family")
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
        chunks = (_tensor_bytes(t, rng) for t in shard)
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
