"""``verify --source``'s comparisons beyond the routed experts: every other tensor a kernel reads,
the model family, and the config numbers ``--numerics`` computes with.

- **Rank-file extras** (:func:`compare_extras`): every tensor of a rank file after its routed
  L1/L2 operands, whatever the format table (``formats.rank_tensor_specs``) puts there: NVFP4's
  ``l1/l2.global_scale``, ``l2.input_scale`` and ``l2.input_scale_all``, and the pre-baked fused
  shared expert ``shared_l1/l2.weight|sf``. Each is re-derived from the source by the very code
  that wrote it (``rank_extras.extra_chunks``) and compared byte for byte with the file.
- **Family** (:func:`check_family`): install names layers by it, so a relabelled manifest is wrong.
- **Numbers** (:func:`numerics_config`): ``routed_scaling_factor``, ``swiglu_limit`` and Kimi-K3's
  SiTU betas read through the strict JSON field reader; a string, a list, a non-finite or an
  absurd value is the source's problem (a :class:`CheckpointError`), never a traceback or a verdict.
- **Equality of outputs** (:func:`same_values`): bit equality where NaN equals NaN, so a NaN the
  two sides compute alike cannot read as "the layout differs".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from megamoe_convert import jsonio
from megamoe_convert.errors import SourceError
from megamoe_convert.output import marker, rank_extras
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.output.shards import rank_shard_specs
from megamoe_convert.source import families, formats
from megamoe_convert.source.checkpoint import Checkpoint, CheckpointError
from megamoe_convert.source.families import FamilyError
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache, SafetensorsError, read_header, tensor_bytes

#: Compared elsewhere: the routed operands slot by slot (``verify.compare_experts``), ``logical_ids``
#: with the placement (the integrity level).
COMPARED_ELSEWHERE = frozenset({*formats.ROUTED_KEYS, "logical_ids"})

#: Bounds of the config numbers the reference MoE computes with (real values: 1.5 .. 2.83 for the
#: scaling factor, 10 for swiglu_limit).
MAX_ROUTED_SCALING_FACTOR = 1e3
MAX_ACTIVATION_PARAM = 1e4


def expected_extras(ckpt: Checkpoint, files: FileCache, layer: MoELayer, logical_ids: tuple[int, ...],
                    ) -> dict[str, torch.Tensor]:
    """``{key: bytes}`` of every extra tensor of the rank file holding ``logical_ids`` of ``layer``."""
    specs = formats.spec_keys(rank_shard_specs(layer, len(logical_ids), ckpt.dims), layer.prefix)
    keys = [key for key in specs if key not in formats.ROUTED_KEYS]
    chunks = list(rank_extras.extra_chunks(ckpt, files, layer, logical_ids))
    assert len(keys) == len(chunks), (keys, len(chunks))
    return {key: torch.frombuffer(bytearray(tensor_bytes(c)), dtype=torch.uint8)
            for key, c in zip(keys, chunks, strict=True) if key not in COMPARED_ELSEWHERE}


def compare_extras(out: Path, manifest: Manifest, ckpt: Checkpoint, files: FileCache, report: Any,
                   pairs: Iterable[tuple[int, MoELayer]], progress: Callable[[str], None] | None = None) -> None:
    """Every extra tensor of each ``(rank, layer)``'s file equals the source's, byte for byte."""
    for rank, layer in pairs:
        rel = manifest.expert_file(layer, rank)
        where = f"rank {rank} {layer.key}"
        try:
            want = expected_extras(ckpt, files, layer, manifest.placement_for(layer).rank_logical_ids(rank))
        except SourceError as e:  # e.g. a NaN global scale: the source's problem
            report.problem(where, f"cannot be derived from the source: {e}")
            continue
        try:
            header = read_header(out / rel)
            names = formats.tensor_names(layer.prefix)
            for key, expected in want.items():
                entry = header.tensors.get(names[key])
                if entry is None:
                    report.problem(rel, f"missing tensor {names[key]}")
                elif entry.nbytes != expected.numel() or not torch.equal(files.read(entry).reshape(-1), expected):
                    report.problem(where, f"{formats.FILE_NAMES[key]} differs from the source")
        except (OSError, SafetensorsError) as e:  # already listed by the integrity level; go on
            report.problem(rel, f"cannot be compared with the source ({getattr(e, 'strerror', None) or e})")
            continue
        report.count("extra tensors vs source", len(want))


def compare_non_expert(out: Path, ckpt: Checkpoint, files: FileCache, report: Any,
                       progress: Any) -> None:
    try:
        converted = Checkpoint.open_non_expert(out)
    except SourceError as e:  # a missing index, or a shard cut short: listed, the rest still checked
        report.problem("model.safetensors.index.json", str(e))
        return
    source = {e.name: e for e in ckpt.non_expert_tensors()}
    for name in sorted(set(source) - set(converted)):
        report.problem(name, "non-expert tensor of the source is missing")
    for name in sorted(set(converted) - set(source)):
        report.problem(name, "tensor is not in the source")
    for name in sorted(set(source) & set(converted)):
        a, b = source[name], converted[name]
        progress.advance(a.nbytes, name, False)
        try:
            same = (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(files.read(a).reshape(-1),
                                                                            files.read(b).reshape(-1))
        except OSError as e:  # an unreadable shard: listed, and the others still compared
            report.problem(name, f"cannot be compared ({e.filename}: {e.strerror or e})")
            continue
        if not same:
            report.problem(name, f"differs from the source ({b.path.name})")
    report.count("non-expert tensors vs source", len(set(source) & set(converted)))


def copied_family_problem(out: Path, manifest: Manifest) -> str | None:
    """Why the manifest's ``family`` (how install names the layers) is not that of the ``config.json``
    copied beside it, or ``None``: a relabelled manifest, even resealed, is refused by the loader and
    listed by ``verify``."""
    config = out / "config.json"
    if not any(f.path == "config.json" for f in manifest.files) or not os.path.lexists(config):
        return None
    try:
        family = families.detect(marker.original(jsonio.read(config, FamilyError, "config.json",
                                                             jsonio.MAX_CONFIG_BYTES), str(config)), config)
    except (FamilyError, marker.MarkerError) as e:
        return str(e)
    if family.name != manifest.family:
        return (f"family is {manifest.family!r}, but {config} is {family.title}'s ({family.name!r}); "
                "the manifest was edited")
    return None


def check_family(manifest: Manifest, ckpt: Checkpoint, report: Any) -> None:
    """The manifest's ``family`` (how install names the layers) is the source's."""
    assert ckpt.family is not None
    if manifest.family != ckpt.family.name:
        report.problem("manifest.json", f"family is {manifest.family!r}, but the source is {ckpt.family.title} "
                                        f"({ckpt.family.name!r})")


@dataclass(frozen=True)
class NumericsConfig:
    """The config numbers the reference MoE computes with, checked."""

    routed_scaling_factor: float
    activation: str
    swiglu_limit: float = 0.0
    situ_beta: float = 1.0
    situ_linear_beta: float = 0.0


def _number(text: Any, key: str, where: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    """``text[key]`` as a number (absent, null or 0: ``default``, as the engines read it with ``or``)."""
    value = text.get(key)
    if value is None or (value == 0 and not isinstance(value, bool) and isinstance(value, (int, float))):
        return default
    f = jsonio.Fields(where, CheckpointError)
    return f.number({key: value}, key, lo=lo, hi=hi, name=f"the source checkpoint's config field {key!r}",
                    lo_open=lo_open)


def numerics_config(ckpt: Checkpoint) -> NumericsConfig:
    """Read and check the numbers once, before any comparison runs."""
    assert ckpt.family is not None
    text, where = ckpt.text_config, str(ckpt.root / "config.json")
    scale = _number(text, "routed_scaling_factor", where, 1.0, 0.0, MAX_ROUTED_SCALING_FACTOR, True)
    if ckpt.family.activation == "situ":
        return NumericsConfig(scale, "situ",
                              situ_beta=_number(text, "activation_situ_beta", where, 1.0, 0.0, MAX_ACTIVATION_PARAM,
                                                True),
                              situ_linear_beta=_number(text, "activation_situ_linear_beta", where, 0.0, 0.0,
                                                       MAX_ACTIVATION_PARAM, True))
    return NumericsConfig(scale, "swiglu",
                          swiglu_limit=_number(text, "swiglu_limit", where, 0.0, 0.0, MAX_ACTIVATION_PARAM, True))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same values, a NaN matching a NaN at the same place."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
