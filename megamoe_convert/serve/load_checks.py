"""What a load checks before any byte is read: the layers it selects, the rank's files the manifest lists
(present, with their sizes or checksums), each shard's tensors and metadata against the manifest's dims and
placement, and the logical experts a shard says it holds.

Apart from :mod:`.loader`, which moves the bytes, because ``verify`` runs the same shard checks on a
conversion it does not load.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from megamoe_convert import jsonio
from megamoe_convert.errors import LoadError
from megamoe_convert.layout.identity import TRANSFORMS, kernel_of
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.output.shards import rank_shard_specs
from megamoe_convert.output.writer import FileRecord, file_problems
from megamoe_convert.source import formats
from megamoe_convert.source.layer_spec import parse_layer_spec
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import SafetensorsHeader, TensorEntry, read_into


def resolve_layers(manifest: Manifest, layers: str | Iterable[str] | None) -> list[MoELayer]:
    """Manifest layers, or the subset named by key (``layers.7``), prefix (``layers.7.ffn.experts``),
    or as on the command line: ``"0,7,mtp"`` (decoder indices, ``mtp`` for every MTP layer)."""
    if layers is None:
        return list(manifest.layers)
    if isinstance(layers, str):
        return parse_layer_spec(manifest.layers, layers, "this conversion", LoadError)
    try:  # any iterable, read once and only as far as a valid selection can reach
        names = list(itertools.islice(layers, 2 * len(manifest.layers) + 1))
    except TypeError:
        raise LoadError(f"layers must be a string or an iterable of layer names, got {type(layers).__name__}") from None
    by_name = {layer.key: layer for layer in manifest.layers} | {layer.prefix: layer for layer in manifest.layers}
    missing = [name for name in names if not isinstance(name, str) or name not in by_name]
    if missing:
        raise LoadError(f"layer {missing[0]!r} is not in this conversion "
                        f"(layers: {', '.join(layer.key for layer in manifest.layers)})")
    if not names or len(names) > 2 * len(manifest.layers):
        raise LoadError(f"layers={'[]' if not names else 'more names than the conversion has'}: select at least one "
                        f"of {', '.join(layer.key for layer in manifest.layers)} (or layers=None for all)")
    return sorted({by_name[name] for name in names})


def check_layout_identity(out: Path, manifest: Manifest) -> None:
    """The manifest's layout identity must name the transform this package writes for its experts'
    format: another name (a foreign tool's, a changed transform's, an edit) says the bytes may be laid
    out otherwise, so no byte is read. Its fingerprints are the engines' probe's to compare (at install,
    against the engine's own code) and ``verify``'s to recompute."""
    record = manifest.layout_record()
    want = TRANSFORMS[kernel_of(manifest.dims.format)]
    if record["transform"] != want:
        raise LoadError(f"{out / MANIFEST_NAME}: layout.transform is {jsonio.short(record['transform'])}, but this "
                        f"megamoe-convert writes {manifest.dims.weight_format} experts as {want!r}: their bytes are "
                        "laid out otherwise; convert again with this megamoe-convert")


def check_rank_files(out: Path, manifest: Manifest, rank: int, layers: Sequence[MoELayer],
                     verify: bool) -> dict[MoELayer, FileRecord]:
    """The manifest must list this rank's files; every file must exist with its recorded size."""
    if not 0 <= rank < manifest.ep_size:
        raise LoadError(f"rank {rank} is out of range: {out} was converted for ep_size={manifest.ep_size} "
                        f"(ranks 0..{manifest.ep_size - 1})")
    if rank not in manifest.ranks:
        raise LoadError(f"rank {rank} was not converted into {out} (converted ranks: {manifest.ranks})")
    listed = {record.path: record for record in manifest.files}
    chosen = {}
    for layer in layers:
        path = manifest.expert_file(layer, rank)
        if path not in listed:
            raise LoadError(f"{out / path}: not listed in {out / MANIFEST_NAME} (the manifest is incomplete "
                            "or was edited)")
        chosen[layer] = listed[path]
    records = list(chosen.values())
    checks = [(out / r.path, r) for r in records]
    for record, problem in zip(records, file_problems(checks, "manifest.json", verify), strict=True):
        if problem:
            raise LoadError(f"{out / record.path}: {problem}")
    return chosen


def expected_tensors(header: SafetensorsHeader, manifest: Manifest, layer: MoELayer, experts: int,
                     sizes: str) -> dict[str, TensorEntry]:
    """The tensors of ``layer`` for ``experts`` slots in the manifest's dims, as ``header`` holds them, by
    key (:data:`formats.FILE_NAMES`); a missing one, or one of another dtype or shape, is refused
    naming the file and ``sizes`` (what fixed the expected shapes)."""
    entries = {}
    for key, spec in formats.spec_keys(rank_shard_specs(layer, experts, manifest.dims), layer.prefix).items():
        entry = header.tensors.get(spec.name)
        if entry is None:
            raise LoadError(f"{header.path}: missing tensor {spec.name}")
        if entry.dtype != spec.dtype or entry.shape != spec.shape:
            raise LoadError(f"{header.path}: {spec.name} is {entry.dtype}{list(entry.shape)}, expected "
                            f"{spec.dtype}{list(spec.shape)} ({sizes})")
        entries[key] = entry
    return entries


def check_shard(header: SafetensorsHeader, manifest: Manifest, layer: MoELayer, rank: int) -> dict[str, TensorEntry]:
    """The shard must hold exactly the tensors the manifest's dims and placement imply; they are
    returned by key (:data:`formats.FILE_NAMES`)."""
    dims = manifest.dims
    experts = manifest.placement_for(layer).experts_per_rank
    sizes = (f"hidden_size={dims.hidden_size}, moe_intermediate_size={dims.moe_intermediate_size}, "
             f"{experts} experts per rank, {dims.weight_format}")
    entries = expected_tensors(header, manifest, layer, experts, sizes)
    meta = header.metadata
    if manifest.store:  # every logical expert once: no rank, no EP size
        if meta.get("store") != "logical-experts" or meta.get("layout_version") != str(manifest.layout_version):
            raise LoadError(f"{header.path}: metadata (store={meta.get('store')}, layout_version="
                            f"{meta.get('layout_version')}) is not a store file of layout_version "
                            f"{manifest.layout_version}")
        return entries
    if meta.get("layout_version") != str(manifest.layout_version) or meta.get("rank") != str(rank) \
            or meta.get("ep_size") != str(manifest.ep_size):
        raise LoadError(f"{header.path}: shard metadata (rank={meta.get('rank')}, ep_size={meta.get('ep_size')}, "
                        f"layout_version={meta.get('layout_version')}) does not match rank={rank}, "
                        f"ep_size={manifest.ep_size}, layout_version={manifest.layout_version}")
    return entries


def check_logical_ids(path: Path, entry: TensorEntry, expected: tuple[int, ...]) -> None:
    """The shard says which logical experts it holds; it must be what the placement says."""
    # Host memory even under an engine's ``with torch.device(...)`` context.
    stored = torch.empty(entry.shape, dtype=torch.int32, device="cpu")
    fd = os.open(path, os.O_RDONLY)  # an OSError: load_rank's LoadError, verify's problem
    try:
        read_into(fd, entry.begin, stored, path)
    finally:
        os.close(fd)
    if tuple(stored.tolist()) != expected:
        raise LoadError(f"{path}: holds logical experts {stored.tolist()}, but manifest.json's placement gives "
                        f"this rank {list(expected)}")
