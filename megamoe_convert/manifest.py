"""``manifest.json``: what a converted directory holds, and the proof that it is complete.

The manifest is the last file a conversion writes. Its presence (with ``complete: true``)
is what makes a directory loadable; it records the placement every rank was built for,
the dimensions, the source it came from, and the size and checksum of every file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, formats
from .checkpoint import ModelDims, MoELayer
from .placement import Placement
from .writer import CHECKSUM_ALGORITHM, FileRecord

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "megamoe-convert"
#: Version of this directory format (file names, manifest fields).
FORMAT_VERSION = 1
#: Version of the MegaMoE tensor layout (DeepGEMM ``transform_weights_for_mega_moe``, June 2026).
LAYOUT_VERSION = 1
#: Hidden folder for conversion state (lock, journal, plan); never read by loaders.
STATE_DIR = ".megamoe"


class ManifestError(ValueError):
    """A missing, incomplete, unknown or inconsistent manifest."""


def rank_dir_name(rank: int, ep_size: int) -> str:
    return f"rank-{rank:05d}-of-{ep_size:05d}"


def rank_file(rank: int, ep_size: int, layer: MoELayer) -> str:
    """Relative path of one rank's shard for one MoE layer."""
    return f"{rank_dir_name(rank, ep_size)}/{layer.key}.safetensors"


def expert_tensor_names(layer: MoELayer) -> dict[str, str]:
    """Names of the tensors a rank shard can hold (:data:`formats.FILE_NAMES`)."""
    return formats.tensor_names(layer.prefix)


@dataclass
class Manifest:
    source: dict[str, Any]
    dims: ModelDims
    placement: Placement
    ranks: list[int]
    layers: list[MoELayer]
    experts_only: bool
    files: list[FileRecord] = field(default_factory=list)
    complete: bool = True
    format_version: int = FORMAT_VERSION
    layout_version: int = LAYOUT_VERSION

    @property
    def ep_size(self) -> int:
        return self.placement.ep_size

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "layout_version": self.layout_version,
            "complete": self.complete,
            "created_by": f"megamoe-convert {__version__}",
            "source": self.source,
            "dims": {"hidden_size": self.dims.hidden_size,
                     "moe_intermediate_size": self.dims.moe_intermediate_size,
                     "n_routed_experts": self.dims.n_routed_experts,
                     "weight_format": self.dims.weight_format,
                     "shared_intermediate_size": self.dims.shared_intermediate_size},
            "ep_size": self.ep_size,
            "ranks": self.ranks,
            "placement": self.placement.to_json(),
            "layers": [{"key": l.key, "prefix": l.prefix, "vllm_prefix": l.vllm_prefix} for l in self.layers],
            "experts_only": self.experts_only,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "files": [f.to_json() for f in self.files],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and validate; every problem is a :class:`ManifestError` naming the field."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: not a JSON object")
        if data.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not a megamoe-convert manifest (format={data.get('format')!r})")
        for key, known in (("format_version", FORMAT_VERSION), ("layout_version", LAYOUT_VERSION)):
            value = data.get(key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ManifestError(f"{where}: {key} must be an integer, got {value!r}")
            if value > known:
                raise ManifestError(f"{where}: {key} {value} is newer than this megamoe-convert understands "
                                    f"({known}); upgrade megamoe-convert")
            if value < 1:
                raise ManifestError(f"{where}: invalid {key} {value}")
        if data.get("complete") is not True:
            raise ManifestError(f"{where}: the conversion did not finish (manifest marked incomplete); "
                                "rerun the same `megamoe convert` command to complete it")
        try:
            dims = ModelDims(**{k: _int(data["dims"][k], f"dims.{k}") for k in
                                ("hidden_size", "moe_intermediate_size", "n_routed_experts")},
                             **formats.manifest_fields(data["dims"], f"{where}: dims"))
            placement = Placement.from_json(data["placement"])
            manifest = cls(
                source=dict(data["source"]),
                dims=dims,
                placement=placement,
                ranks=[_int(r, "ranks[]") for r in data["ranks"]],
                layers=[MoELayer.parse(l["key"]) for l in data["layers"]],
                experts_only=bool(data["experts_only"]),
                files=[FileRecord(str(f["path"]), _int(f["size"], "files[].size"), str(f["checksum"]))
                       for f in data["files"]],
                format_version=data["format_version"], layout_version=data["layout_version"],
            )
        except ManifestError as e:
            raise ManifestError(f"{where}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
        if _int(data.get("ep_size"), "ep_size") != placement.ep_size:
            raise ManifestError(f"{where}: ep_size {data.get('ep_size')} disagrees with placement.ep_size "
                                f"{placement.ep_size}")
        if placement.n_logical != dims.n_routed_experts:
            raise ManifestError(f"{where}: placement has {placement.n_logical} logical experts, dims say "
                                f"{dims.n_routed_experts}")
        bad = [r for r in manifest.ranks if not 0 <= r < placement.ep_size]
        if bad:
            raise ManifestError(f"{where}: rank {bad[0]} out of range for ep_size={placement.ep_size}")
        if data.get("checksum_algorithm", CHECKSUM_ALGORITHM) != CHECKSUM_ALGORITHM:
            raise ManifestError(f"{where}: unknown checksum algorithm {data.get('checksum_algorithm')!r}")
        for record in manifest.files:
            if record.path.startswith("/") or ".." in Path(record.path).parts:
                raise ManifestError(f"{where}: file path {record.path!r} escapes the directory")
        return manifest

    def file(self, path: str) -> FileRecord:
        for record in self.files:
            if record.path == path:
                return record
        raise ManifestError(f"{MANIFEST_NAME}: no entry for {path}")

    def rank_files(self, rank: int) -> dict[MoELayer, FileRecord]:
        return {layer: self.file(rank_file(rank, self.ep_size, layer)) for layer in self.layers}


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"{name} must be an integer, got {value!r}")
    return value


def read_manifest(out: Path) -> Manifest:
    """Read ``OUT/manifest.json``; a directory without one is an unfinished conversion."""
    path = Path(out) / MANIFEST_NAME
    if not Path(out).is_dir():
        raise ManifestError(f"{out}: no such converted directory")
    try:
        text = path.read_text()
    except FileNotFoundError:
        parts = sorted(p.name for p in Path(out).glob("manifest.part-*-of-*.json"))
        if parts:
            raise ManifestError(f"{path}: missing; {out} holds {parts[0]}{' ...' if len(parts) > 1 else ''}, a part "
                                "of a conversion split with --shard: run `megamoe merge` to assemble the parts") from None
        raise ManifestError(f"{path}: missing; {out} is not a finished megamoe conversion "
                            "(rerun `megamoe convert` to complete it)") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ManifestError(f"{path}: corrupted manifest ({e})") from None
    return Manifest.from_json(data, str(path))
