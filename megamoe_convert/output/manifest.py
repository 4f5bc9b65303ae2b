"""The manifest: the sealed record of a conversion, and the one reader that trusts it.

``manifest.json`` is written last, so its presence means the conversion finished. It lists what
the conversion holds (dims, placement, engine, family, ranks, layers, every file with its size
and checksum); :meth:`Manifest.from_json` checks every field (through :mod:`jsonio`'s typed
reads), the seal (:mod:`seal`) and that the manifest agrees with itself
(:func:`manifest_problems`) before any reader uses it. Every problem is a :class:`ManifestError`
naming the file and the field, but the placement's own, which its parser raises as a
:class:`PlacementError` naming the same file.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megamoe_convert import __version__, jsonio
from megamoe_convert.errors import ManifestError
from megamoe_convert.layout.identity import identity_from_json, layout_identity
from megamoe_convert.layout.placement import (
    ENGINES,
    MAX_EP_SIZE,
    MAX_PHYSICAL_EXPERTS,
    Placement,
    PlacementError,
    layer_placement,
)
from megamoe_convert.output import marker
from megamoe_convert.output.naming import (
    ANY_ENGINE,
    MANIFEST_NAME,
    PART_GLOB,
    STATE_DIR,
    format_ranges,
    is_own_path,
    rank_file,
    store_file,
)
from megamoe_convert.output.seal import check_seal, seal
from megamoe_convert.output.shards import LAYOUT_VERSION, rank_shard_size
from megamoe_convert.output.writer import CHECKSUM_ALGORITHM, FileRecord
from megamoe_convert.source import families, formats
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.model_dims import MAX_DIM, ModelDims

FORMAT_NAME = "megamoe-convert"
#: Version of this directory format (file names, manifest fields, the manifest's own checksum
#: ``manifest_checksum``: :mod:`seal`); a manifest of any other version is refused.
FORMAT_VERSION = 2
#: :attr:`Manifest.layout` of a manifest this code makes: the layout identity of what it writes is
#: recorded when the manifest is written (:meth:`Manifest.layout_record`).
ON_WRITE: Any = object()


@dataclass
class Manifest:
    source: dict[str, Any]
    dims: ModelDims
    placement: Placement
    ranks: list[int]
    layers: list[MoELayer]
    experts_only: bool
    #: Every MoE layer of the source, so that a ``--layers`` subset reads as partial.
    source_layers: list[str]
    files: list[FileRecord] = field(default_factory=list)
    complete: bool = True
    format_version: int = FORMAT_VERSION
    layout_version: int = LAYOUT_VERSION
    #: The engine whose per-layer placement the ranks hold (:func:`placement.layer_placement`).
    engine: str = "vllm"
    #: The source's model family (``families.py``): how its checkpoint names its tensors.
    family: str = "deepseek_v4"
    #: A store (``convert`` without ``--ep-size``): one file per layer of its logical experts in order
    #: (:func:`store_file`); ``placement`` is then EP 1's, ``engine`` :data:`ANY_ENGINE`.
    store: bool = False
    #: The layout identity (:mod:`layout_identity`: the transform, the engine releases it is proven
    #: against, the fingerprints of its layout of the probe expert).
    layout: Any = ON_WRITE

    def layout_record(self) -> dict[str, Any]:
        """The layout identity this manifest records (for one this code makes: this code's, computed once)."""
        if self.layout is ON_WRITE:
            d = self.dims
            self.layout = layout_identity(d.format, d.hidden_size, d.moe_intermediate_size, d.shared_intermediate_size)
        return self.layout

    def coverage(self) -> dict[str, Any]:
        """What this conversion holds of the model at its EP size, and whether an engine can serve it
        as it is: every rank, every MoE layer and the non-expert weights (``--ranks``, ``--layers``
        and ``--experts-only`` make partial conversions)."""
        missing_ranks = sorted(set(range(self.ep_size)) - set(self.ranks))
        held = {layer.key for layer in self.layers}
        missing_layers = [k for k in self.source_layers if k not in held]
        gaps = []
        if missing_ranks:
            gaps.append(f"holds ranks {format_ranges(sorted(set(self.ranks)))} of EP {self.ep_size}, not "
                        f"{format_ranges(missing_ranks)} (a server needs every rank it runs: convert or pull them)")
        if missing_layers:
            shown = ", ".join(missing_layers[:6]) + (" ..." if len(missing_layers) > 6 else "")
            gaps.append(f"{len(held)} of {len(held) + len(missing_layers)} MoE layers (missing {shown})")
        if self.experts_only:
            gaps.append("no non-expert weights (--experts-only): --load-format megamoe refuses it")
        return {"partial": bool(gaps), "servable": not gaps, "ranks": sorted(set(self.ranks)),
                "missing_ranks": missing_ranks, "layers": [layer.key for layer in self.layers],
                "missing_layers": missing_layers, "non_expert_weights": not self.experts_only,
                "note": "; ".join(gaps) if gaps else f"every rank of EP {self.ep_size}, every MoE layer, "
                                                     "non-expert weights: servable"}

    @property
    def ep_size(self) -> int:
        return self.placement.ep_size

    def placement_for(self, layer: MoELayer) -> Placement:
        """The placement ``layer``'s rank files were built for (the engine's rule for that layer);
        a store's layer file: every logical expert of the layer once, in order."""
        if self.store:
            return Placement.default(self.dims.experts_of(layer), 1)
        return layer_placement(self.engine, self.placement, layer.is_mtp, self.dims.experts_of(layer),
                               families.by_name(self.family).sglang_mtp_like_decoder)

    def expert_file(self, layer: MoELayer, rank: int = 0) -> str:
        """The file holding ``layer``'s experts for ``rank`` (a store's one file for every rank)."""
        return store_file(layer) if self.store else rank_file(rank, self.ep_size, layer)

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
                     "shared_intermediate_size": self.dims.shared_intermediate_size,
                     **({"mtp_n_routed_experts": self.dims.mtp_n_routed_experts}
                        if self.dims.mtp_n_routed_experts else {})},
            "ep_size": self.ep_size,
            "ranks": self.ranks,
            "engine": self.engine,
            "family": self.family,
            "layout": self.layout_record(),
            "placement": self.placement.to_json(),
            "layers": [{"key": layer.key, "prefix": layer.prefix} for layer in self.layers],
            "experts_only": self.experts_only,
            "source_layers": self.source_layers,
            "coverage": {k: v for k, v in self.coverage().items() if k in ("partial", "servable", "note")},
            **({"store": True} if self.store else {}),
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "files": [f.to_json() for f in self.files],
        }

    def dumps(self) -> str:
        return seal(self.to_json())

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST_NAME, sealed: bool = True) -> "Manifest":
        """Parse and validate (:func:`manifest_problems`); any problem is a :class:`ManifestError`
        (a :class:`PlacementError` for the placement object) naming the file and the field.
        ``sealed=False``: a manifest being assembled (``merge``)."""
        f = jsonio.Fields(where, ManifestError)
        f.obj(data, name="the manifest")
        if data.get("format") != FORMAT_NAME:
            raise f.fail(f"not a megamoe-convert manifest (format={jsonio.short(data.get('format'))})")
        versions = [f.int(data, key, lo=1) for key in ("format_version", "layout_version")]
        for key, value, known in zip(("format_version", "layout_version"), versions, (FORMAT_VERSION, LAYOUT_VERSION),
                                     strict=True):
            if value > known:
                raise f.fail(f"{key} {value} is newer than this megamoe-convert understands ({known}); "
                             "upgrade megamoe-convert")
            if value < known:
                raise f.fail(f"{key} {value} is not {known}, the one this megamoe-convert reads; convert again")
        if data.get("complete") is not True:
            raise f.fail("the conversion did not finish (manifest marked incomplete); "
                         "rerun the same `megamoe convert` command to complete it")
        if sealed:
            check_seal(data, f)
        manifest = _parse(data, f, versions)
        problems = manifest_problems(manifest, data)
        if problems:
            more = f" (and {len(problems) - 1} more: `megamoe verify` lists them)" if len(problems) > 1 else ""
            raise ManifestError(f"{where}: {problems[0]}{more}", [f"{where}: {p}" for p in problems])
        return manifest

    def file(self, path: str) -> FileRecord:
        for record in self.files:
            if record.path == path:
                return record
        raise ManifestError(f"{MANIFEST_NAME}: no entry for {path}")

    def rank_files(self, rank: int) -> dict[MoELayer, FileRecord]:
        return {layer: self.file(self.expert_file(layer, rank)) for layer in self.layers}


_CHECKSUM = re.compile(r"[0-9a-f]{32}")


def _file_record(f: jsonio.Fields, item: Any, label: str) -> FileRecord:
    path, checksum = f.str(item, "path", f"{label}.path"), f.str(item, "checksum", f"{label}.checksum")
    if not is_own_path(path):
        raise f.fail(f"{label}.path {path!r} is not a file this tool writes (a rank shard or a top-level name)")
    if not _CHECKSUM.fullmatch(checksum):
        raise f.fail(f"{label}.checksum must be 32 hex digits, got {jsonio.short(checksum)}")
    return FileRecord(path, f.int(item, "size", name=f"{label}.size"), checksum)


def _layer(f: jsonio.Fields, item: Any, label: str) -> MoELayer:
    key = f.str(item, "key", f"{label}.key")
    try:
        layer = MoELayer.parse(key)
    except ValueError as e:
        raise f.fail(f"{label}: {e}") from None
    if f.str(item, "prefix", f"{label}.prefix") != layer.prefix:
        raise f.fail(f"{label}.prefix {item['prefix']!r} disagrees with key {key!r}")
    return layer


def _source_layer(f: jsonio.Fields, item: Any, label: str) -> str:
    """A ``source_layers`` entry: a layer key."""
    try:
        return MoELayer.parse(f.str(item, name=label)).key
    except ValueError as e:
        raise f.fail(f"{label}: {e}") from None


def _parse(data: dict[str, Any], f: jsonio.Fields, versions: list[int]) -> Manifest:
    dims_data = f.obj(data, "dims")
    hidden, intermediate, experts = (f.int(dims_data, k, lo=1, hi=hi, name=f"dims.{k}") for k, hi in
                                     (("hidden_size", MAX_DIM), ("moe_intermediate_size", MAX_DIM),
                                      ("n_routed_experts", MAX_PHYSICAL_EXPERTS)))
    dims = ModelDims(hidden, intermediate, experts,
                     **formats.manifest_fields(dims_data, f, MAX_DIM),
                     mtp_n_routed_experts=f.int(dims_data, "mtp_n_routed_experts", lo=1, hi=MAX_PHYSICAL_EXPERTS,
                                                name="dims.mtp_n_routed_experts")
                     if "mtp_n_routed_experts" in dims_data else 0)
    placement = Placement.from_json(f.obj(data, "placement"), f.where)
    if f.int(data, "ep_size", lo=1, hi=MAX_EP_SIZE) != placement.ep_size:
        raise f.fail(f"ep_size {data['ep_size']} disagrees with placement.ep_size {placement.ep_size}")
    engine = f.str(data, "engine")
    store = f.bool(data, "store") if "store" in data else False
    if store != (engine == ANY_ENGINE):
        raise f.fail(f"engine {jsonio.short(engine)} with store={store}: a store (and only a store) "
                     f"holds engine {ANY_ENGINE!r}")
    if engine not in (*ENGINES, ANY_ENGINE):
        raise f.fail(f"unknown engine {jsonio.short(engine)} (known: {', '.join(ENGINES)})")
    family = f.str(data, "family")
    known = [k.name for k in families.FAMILIES]
    if family not in known:
        raise f.fail(f"family: unknown model family {family!r} (known: {', '.join(known)})")
    algorithm = f.str(data, "checksum_algorithm")
    if algorithm != CHECKSUM_ALGORITHM:
        raise f.fail(f"unknown checksum algorithm {jsonio.short(algorithm)}")
    layers = f.each(f.list(data, "layers", max_len=1 << 16), lambda x, label: _layer(f, x, label), "layers")
    files = f.each(f.list(data, "files"), lambda x, label: _file_record(f, x, label), "files")
    source_layers = f.each(f.list(data, "source_layers", max_len=1 << 16),
                           lambda x, label: _source_layer(f, x, label), "source_layers")
    return Manifest(source=f.obj(data, "source"), dims=dims, placement=placement,
                    ranks=f.ints(data, "ranks", hi=MAX_EP_SIZE, max_len=MAX_EP_SIZE), layers=layers,
                    experts_only=f.bool(data, "experts_only"), files=files,
                    format_version=versions[0], layout_version=versions[1], engine=engine, family=family,
                    store=store, source_layers=source_layers,
                    layout=identity_from_json(f.obj(data, "layout"), f))


def _duplicates(items: list[Any]) -> list[Any]:
    seen: set[Any] = set()
    return [x for x in items if x in seen or seen.add(x)]  # type: ignore[func-returns-value]


def manifest_problems(m: Manifest, data: dict[str, Any]) -> list[str]:
    """Every way the manifest contradicts itself: each rank x layer listed exactly once with the
    exact size its dims and placement give, nothing else in rank folders, no rank, layer or file
    twice, logical experts = ``n_routed_experts``, no non-expert shard with ``experts_only``."""
    problems = [f"rank {r} listed twice" for r in _duplicates(m.ranks)]
    problems += [f"layer {layer.key} listed twice" for layer in _duplicates(m.layers)]
    problems += [f"file {p} listed twice" for p in _duplicates([r.path for r in m.files])]
    problems += [f"rank {r} out of range for ep_size={m.ep_size}" for r in m.ranks if r >= m.ep_size]
    if not m.ranks:
        problems.append("no ranks listed")
    if not m.layers:
        problems.append("no layers listed")
    if m.store and (m.ranks != [0] or not m.placement.is_default() or m.ep_size != 1):
        problems.append("a store's placement is every logical expert once (ep_size 1, ranks [0])")
    if m.placement.n_logical != m.dims.n_routed_experts:
        problems.append(f"placement has {m.placement.n_logical} logical experts, dims say {m.dims.n_routed_experts}")
        return problems  # sizes below follow from dims and placement
    try:
        placements = {layer: m.placement_for(layer) for layer in set(m.layers)}
    except PlacementError as e:
        return problems + [f"dims.mtp_n_routed_experts: {e}"]
    listed = {r.path: r for r in m.files if "/" in r.path}
    for rank in sorted(set(m.ranks)):
        if rank >= m.ep_size:
            continue
        for layer in sorted(set(m.layers)):
            path = m.expert_file(layer, rank)
            record = listed.pop(path, None)
            if record is None:
                problems.append(f"{path}: {'the store' if m.store else f'rank {rank}'} x {layer.key} is not listed")
            elif record.size != (size := rank_shard_size(layer, rank, placements[layer], m.dims, m.store)):
                problems.append(f"{path}: listed with size {record.size}, its dims and placement give {size}")
    problems += [f"{path}: not a rank x layer of this conversion" for path in sorted(listed)]
    if m.experts_only:
        problems += [f"{r.path}: a non-expert shard in an --experts-only conversion" for r in m.files
                     if "/" not in r.path and r.path.endswith(".safetensors")]
    return problems


def is_tool_output(out: Path) -> bool:
    """Whether ``out`` was written by megamoe-convert, finished or not: its state folder, a manifest, or
    a ``config.json`` carrying the converted directory's marker section."""
    if (out / STATE_DIR).is_dir() or (out / MANIFEST_NAME).is_file():
        return True
    try:  # the one safe reader: a FIFO, a device or a hostile file is no marker, never a hang or a traceback
        config = jsonio.read(out / "config.json", ManifestError, "config.json", jsonio.MAX_MANIFEST_BYTES)
    except ManifestError:
        return False
    return isinstance(config, dict) and marker.section_of(config) is not None


def read_manifest(out: Path) -> Manifest:
    """Read ``OUT/manifest.json``; a directory without one is an unfinished conversion."""
    path = Path(out) / MANIFEST_NAME
    if not Path(out).is_dir():
        raise ManifestError(f"{out}: no such converted directory")
    if not path.exists():
        parts = sorted(p.name for p in Path(out).glob(PART_GLOB))
        if parts:
            raise ManifestError(f"{path}: missing; {out} holds {parts[0]}{' ...' if len(parts) > 1 else ''}, a part "
                                "of a conversion split with --shard: run `megamoe merge` to assemble the parts")
        if is_tool_output(Path(out)):
            raise ManifestError(f"{path}: missing; {out} is not a finished megamoe conversion: a `megamoe convert` "
                                "into it was interrupted (or is still running); rerun that command to finish it, it "
                                "resumes where it stopped")
        raise ManifestError(f"{path}: missing; {out} is not a megamoe conversion (a source checkpoint?): convert it "
                            f"first, `megamoe convert {shlex.quote(str(out))} OUT --ep-size N` (or without --ep-size: "
                            "a store every EP size reads)")
    return Manifest.from_json(jsonio.read(path, ManifestError, "manifest", jsonio.MAX_MANIFEST_BYTES), str(path))
