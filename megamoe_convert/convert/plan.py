"""The conversion plan: options, the MoE layers and ranks to write, one unit per output file, and
how a split conversion (``--shard I/N``) divides the units. Pure bookkeeping: no bytes are read here."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from megamoe_convert import jsonio
from megamoe_convert.errors import ConvertError
from megamoe_convert.layout.placement import (
    MAX_PHYSICAL_EXPERTS,
    Placement,
    PlacementError,
    check_file_fields,
    default_problem,
    layer_placement,
    layer_placement_problem,
)
from megamoe_convert.layout.serving import serving_refusal
from megamoe_convert.output.manifest import FORMAT_VERSION, Manifest
from megamoe_convert.output.naming import ANY_ENGINE, format_ranges
from megamoe_convert.output.shards import LAYOUT_VERSION
from megamoe_convert.output.stamps import stamp_files
from megamoe_convert.output.writer import FileRecord
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.engines_table import resolve_engine
from megamoe_convert.source.layer_spec import parse_layer_spec
from megamoe_convert.source.layers import MoELayer

DEFAULT_CHUNK_BYTES = 32 << 20  # at least one expert; small chunks are still in the CPU cache when written


# --------------------------------------------------------------------------------------
# Options and plan
# --------------------------------------------------------------------------------------

@dataclass
class ConvertOptions:
    #: ``None``: a store (every logical expert once, for any EP size, placement and engine).
    ep_size: int | None
    num_redundant_experts: int = 0
    placement_file: Path | None = None
    device: str = "cpu"
    workers: int = 0  # 0: one per CPU core, at most 8
    ranks: str | None = None
    layers: str | None = None
    experts_only: bool = False
    overwrite: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    fsync: bool = True
    #: ``(index, count)``: convert only part ``index`` (0-based) of ``count`` (see :func:`shard_units`).
    shard: tuple[int, int] | None = None
    shard_by: str = "layer"  # "layer" | "rank": what a part's expert shards are split by
    auto_merge: bool = True  # the last part to finish in a shared OUT merges all parts
    #: Whose per-layer placement the ranks hold (placement.layer_placement); ``None``: the engine that
    #: serves the checkpoint's family (:func:`resolve_engine`, once the family is known).
    engine: str | None = None
    #: Refuse what the engine cannot serve (vLLM: any placement but its default) before any work;
    #: off only to build such a directory on purpose (tests of ``install``'s own refusal).
    check_serving: bool = True

    @property
    def store(self) -> bool:
        return self.ep_size is None

    def worker_count(self) -> int:
        return self.workers if self.workers > 0 else min(8, os.cpu_count() or 1)


def select_layers(ckpt: Checkpoint, spec: str | None) -> list[MoELayer]:
    """``--layers``: ``"0-3,7,mtp"`` style (:func:`layer_spec.parse_layer_spec`)."""
    return parse_layer_spec(ckpt.layers, spec, ckpt.root, ConvertError)


def make_placement(ckpt: Checkpoint, options: ConvertOptions) -> Placement:
    """The decoder layers' placement, checked against every selected layer (an MTP layer with an
    expert count of its own, SGLang's MTP rule) and against what the engine can serve."""
    family = ckpt.family
    assert family is not None
    n = ckpt.dims.n_routed_experts
    # A store serves whichever engine serves its family: the engine is named when it is served.
    if problem := serving_refusal(family, None if options.store else options.engine, n,
                                  num_redundant=options.num_redundant_experts, placement_file=options.placement_file):
        raise ConvertError(f"{ckpt.root}: {problem}")
    if options.store:  # every logical expert once; the engine's placement is read at install
        given = [flag for flag, on in (("--num-redundant-experts", options.num_redundant_experts),
                                       ("--placement", options.placement_file is not None),
                                       ("--ranks", options.ranks is not None), ("--engine", options.engine is not None),
                                       ("--shard-by rank", options.shard is not None and options.shard_by == "rank"))
                 if on]
        if given:
            raise ConvertError(f"{given[0]} needs --ep-size: without it, convert writes a store of every logical "
                               "expert once, which serves any EP size, redundant experts, placement and engine")
        return Placement.default(n, 1)
    assert options.ep_size is not None
    engine = resolve_engine(family, options.engine)
    layers = select_layers(ckpt, options.layers)
    if options.placement_file is not None:
        if options.num_redundant_experts:
            raise PlacementError("give either --placement or --num-redundant-experts, not both")
        placement, extra = Placement.read_file(options.placement_file, n, options.ep_size)
        check_file_fields(extra, placement, engine, options.placement_file,
                          [(layer.key, layer.is_mtp, ckpt.dims.experts_of(layer)) for layer in ckpt.layers],
                          family.sglang_mtp_like_decoder)
        if options.check_serving and (problem := serving_refusal(family, engine, n,
                                                                 placement_file=options.placement_file,
                                                                 placement=placement)):
            raise ConvertError(f"{ckpt.root}: {problem}")
    elif (problem := default_problem(n, options.ep_size, options.num_redundant_experts)) is not None:
        raise PlacementError(f"{problem}; {_sizes_text(ckpt, options, layers)}")
    else:
        placement = Placement.default(n, options.ep_size, options.num_redundant_experts)
    for layer in layers:
        problem = layer_placement_problem(engine, placement, layer.is_mtp, ckpt.dims.experts_of(layer),
                                          family.sglang_mtp_like_decoder)
        if problem is not None:
            failing = _failing(ckpt, engine, placement, layers)
            keep = [layer for layer in layers if layer not in failing]
            left_out = ", ".join(layer.key for layer in failing)
            way_out = f"or leave {left_out} out: --layers {layer_spec(keep)}" if keep else ""
            raise PlacementError(f"{layer.key} ({ckpt.dims.experts_of(layer)} experts): {problem}; "
                                 f"{_sizes_text(ckpt, options, layers)}{'; ' + way_out if way_out else ''}")
    return placement


def _failing(ckpt: Checkpoint, engine: str, placement: Placement, layers: Sequence[MoELayer]) -> list[MoELayer]:
    assert ckpt.family is not None
    return [layer for layer in layers
            if layer_placement_problem(engine, placement, layer.is_mtp, ckpt.dims.experts_of(layer),
                                       ckpt.family.sglang_mtp_like_decoder) is not None]


def working_ep_sizes(ckpt: Checkpoint, num_redundant: int, engine: str, layers: Sequence[MoELayer]) -> list[int]:
    """The EP sizes for which vLLM's default placement (with ``num_redundant`` experts) builds every
    one of ``layers`` (MTP layers with their own expert count, the engine's MTP rule included)."""
    n = ckpt.dims.n_routed_experts
    total = n + num_redundant
    if num_redundant < 0 or total > MAX_PHYSICAL_EXPERTS:
        return []  # the counts themselves are refused (placement.check_counts says why)
    divisors = {d for i in range(1, int(total ** 0.5) + 1) if total % i == 0 for d in (i, total // i)}
    sizes = []
    for size in sorted(divisors):
        try:
            placement = Placement.default(n, size, num_redundant)
        except PlacementError:
            continue
        if not _failing(ckpt, engine, placement, layers):
            sizes.append(size)
    return sizes


def _sizes_text(ckpt: Checkpoint, options: ConvertOptions, layers: Sequence[MoELayer]) -> str:
    assert ckpt.family is not None
    sizes = working_ep_sizes(ckpt, options.num_redundant_experts, resolve_engine(ckpt.family, options.engine), layers)
    redundant = f" with {options.num_redundant_experts} redundant experts" if options.num_redundant_experts else ""
    what = "every selected MoE layer" if any(layer.is_mtp for layer in layers) else "these layers"
    return (f"EP sizes that work for {what}{redundant}: {', '.join(map(str, sizes))}" if sizes else
            f"no EP size works for {what}{redundant}")


def layer_spec(layers: Sequence[MoELayer]) -> str:
    """The shortest ``--layers`` value selecting exactly ``layers`` (``0-39``, ``0-3,mtp.1``)."""
    decoder = format_ranges(sorted(layer.index for layer in layers if not layer.is_mtp))
    mtp = ",".join(layer.key for layer in layers if layer.is_mtp)
    return ",".join(x for x in (decoder, mtp) if x)


@dataclass
class Unit:
    """One output file and how to produce it."""

    path: str  # relative to OUT
    nbytes: int  # approximate output size, for progress
    run: Callable[[], FileRecord]
    kind: str  # "small" | "non_expert" | "experts"
    layer: MoELayer | None = None  # for "experts": which layer and rank (used by --shard)
    rank: int | None = None
    #: The exact size of the file written (header included), from the specs the writer is given:
    #: computed when asked (``plan`` lists it; a conversion of many ranks never encodes a header twice).
    exact_size: Callable[[], int] = field(default=lambda: 0, repr=False)
    #: The file's exact bytes when known up front (the marked config.json): a journaled file that
    #: holds other bytes than these is written again on resume, so the file is always these bytes.
    content: bytes | None = None

    @property
    def file_size(self) -> int:
        return self.exact_size()


@dataclass
class Plan:
    ckpt: Checkpoint
    out: Path
    options: ConvertOptions
    placement: Placement
    ranks: list[int]
    layers: list[MoELayer]
    units: list[Unit] = field(default_factory=list)
    non_expert_index: dict[str, str] = field(default_factory=dict)
    all_paths: list[str] = field(default_factory=list)  # --shard: every file of the whole conversion, in order
    _placements: dict[str, Placement] = field(default_factory=dict, repr=False, compare=False)

    def fingerprint(self) -> dict[str, Any]:
        """Everything that determines the output bytes (not workers, device or verbosity)."""
        source = self.ckpt.source_record()
        return {"format_version": FORMAT_VERSION, "layout_version": LAYOUT_VERSION,
                "source_files": source["files"], "source_index_sha256": source["index_sha256"],
                "source_tensors_sha256": source["tensors_sha256"], "source_revision": source["revision"],
                "placement": list(self.placement.physical_to_logical), "ep_size": self.placement.ep_size,
                "ranks": self.ranks, "layers": [layer.key for layer in self.layers],
                "experts_only": self.options.experts_only, "engine": self.engine,
                **({"store": True} if self.options.store else {})}

    @functools.cached_property
    def engine(self) -> str:
        """The manifest's ``engine``: a store holds none's placement."""
        assert self.ckpt.family is not None
        return ANY_ENGINE if self.options.store else resolve_engine(self.ckpt.family, self.options.engine)

    def placement_for(self, layer: MoELayer) -> Placement:
        """The placement the engine builds ``layer`` with (SGLang's MTP layer, and MTP layers with
        an expert count of their own, have their own); once per layer, however many ranks ask."""
        if layer.key not in self._placements:
            self._placements[layer.key] = self._layer_placement(layer)
        return self._placements[layer.key]

    def _layer_placement(self, layer: MoELayer) -> Placement:
        if self.options.store:
            return Placement.default(self.ckpt.dims.experts_of(layer), 1)
        assert self.ckpt.family is not None
        return layer_placement(self.engine, self.placement, layer.is_mtp, self.ckpt.dims.experts_of(layer),
                               self.ckpt.family.sglang_mtp_like_decoder, where=f"{layer.key}: ")

    def source_paths(self) -> dict[str, Path]:
        """Every source file read: shards and copied small files."""
        paths = {name: self.ckpt.root / name for name in self.ckpt.headers}
        paths.update((p.name, p) for p in self.ckpt.small_files())
        return paths

    def source_stamp(self) -> dict[str, list[int]]:
        """:func:`output_state.stamp_files` of the source. It is kept out of :meth:`fingerprint`,
        which machines with their own copies of the source share (``--shard``)."""
        return stamp_files(self.source_paths())

    def manifest(self, records: dict[str, FileRecord], extra: Sequence[FileRecord] = ()) -> Manifest:
        """The manifest of the finished run: every unit's file, then ``extra`` (the index)."""
        return Manifest(source=self.ckpt.source_record(), dims=self.ckpt.dims, placement=self.placement,
                        ranks=self.ranks, layers=self.layers, experts_only=self.options.experts_only,
                        files=[records[u.path] for u in self.units] + list(extra), engine=self.engine,
                        family=self.family, store=self.options.store,
                        source_layers=[layer.key for layer in self.ckpt.layers])

    @property
    def family(self) -> str:
        assert self.ckpt.family is not None
        return self.ckpt.family.name


# --------------------------------------------------------------------------------------
# Splitting one conversion over machines (--shard I/N)
# --------------------------------------------------------------------------------------

SHARD_BY = ("layer", "rank")


def parse_shard(spec: str) -> tuple[int, int]:
    """``"2/8"`` -> ``(2, 8)``: part 2 of 8, numbered from 0 (a Kubernetes completion index)."""
    index, sep, count = spec.strip().partition("/")
    if not all(jsonio.is_uint(text) and int(text) <= 1 << 16 for text in (index, count)):
        raise ConvertError(f"--shard: cannot parse {spec!r} (expected I/N, e.g. 0/8 for the first of 8 parts)")
    i, n = int(index), int(count)
    if not sep or n < 1 or not 0 <= i < n:
        raise ConvertError(f"--shard {spec}: need 0 <= I < N (parts are numbered from 0, e.g. 0/8 .. 7/8)")
    return i, n


def _block(items: Sequence[Any], index: int, count: int) -> Sequence[Any]:
    return items[index * len(items) // count:(index + 1) * len(items) // count]


def shard_units(plan: Plan, index: int, count: int, by: str = "layer") -> list[Unit]:
    """Part ``index`` of ``count`` of the plan's units; every unit lands in exactly one part.

    Rank shards are split into ``count`` contiguous, balanced blocks of MoE layers
    (``by="layer"``: each machine reads only its layers' source bytes) or of ranks
    (``by="rank"``); non-expert shards go round-robin from the last part, small files to
    part 0. The split depends only on the plan, so every machine computes the same one.
    """
    if by not in SHARD_BY:
        raise ConvertError(f"--shard-by {by!r}: expected one of {', '.join(SHARD_BY)}")
    mine = set(_block(plan.layers if by == "layer" else plan.ranks, index, count))
    non_expert = [u.path for u in plan.units if u.kind == "non_expert"]
    chosen = []
    for unit in plan.units:
        if unit.kind == "small":
            take = index == 0
        elif unit.kind == "non_expert":
            take = (count - 1 - non_expert.index(unit.path)) % count == index
        else:
            take = (unit.layer if by == "layer" else unit.rank) in mine
        if take:
            chosen.append(unit)
    return chosen



def non_expert_index(plan: Plan) -> dict[str, Any] | None:
    """``model.safetensors.index.json`` of the non-expert shards (``None`` with ``--experts-only``)."""
    if plan.options.experts_only:
        return None
    return {"metadata": {"total_size": sum(e.nbytes for e in plan.ckpt.non_expert_tensors()),
                         "megamoe": "routed experts are in " + ("experts/" if plan.options.store else "rank-*/")
                                    + " (see manifest.json)"},
            "weight_map": dict(sorted(plan.non_expert_index.items()))}


def index_text(index: dict[str, Any]) -> str:
    return json.dumps(index, indent=2)


