"""Which logical expert each physical slot of each expert-parallel rank holds.

vLLM's default (``_map_global_expert_id``): ``n_physical = n_routed + num_redundant`` slots,
split evenly over ``ep_size`` ranks (rank ``r`` owns ``[r*L, (r+1)*L)``), and physical slot
``p`` holds logical expert ``p % n_routed``. An explicit placement (e.g. from EPLB load
statistics) is a list of logical ids, one per physical slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from megamoe_convert import jsonio
from megamoe_convert.errors import PlacementError
from megamoe_convert.source.engines_table import ENGINE_NAMES
from megamoe_convert.source.layer_spec import parse_range
from megamoe_convert.source.model_dims import MAX_PHYSICAL_EXPERTS

#: Bounds checked before anything is expanded (DeepSeek-V4: 256-384 experts, EP up to a few hundred).
MAX_EP_SIZE = 1 << 16


#: Engines whose placement a conversion can hold (``convert --engine``): the serving table's.
ENGINES = ENGINE_NAMES


@dataclass(frozen=True)
class Placement:
    """The logical expert id of every physical slot, and how slots split over ranks."""

    n_logical: int
    ep_size: int
    physical_to_logical: tuple[int, ...]

    def __post_init__(self) -> None:
        problem = slots_problem(self.n_logical, self.ep_size, self.physical_to_logical)
        if problem is not None:
            raise PlacementError(problem)

    # ---------------------------------------------------------------- construction
    @classmethod
    def default(cls, n_logical: int, ep_size: int, num_redundant: int = 0) -> "Placement":
        """vLLM's default placement: slot ``p`` holds ``p % n_logical``."""
        if (problem := default_problem(n_logical, ep_size, num_redundant)) is not None:
            raise PlacementError(problem)
        return cls(n_logical, ep_size, tuple(p % n_logical for p in range(n_logical + num_redundant)))

    @classmethod
    def from_list(cls, ids: Sequence[Any], n_logical: int, ep_size: int, source: str = "placement") -> "Placement":
        """A list of logical ids, one per physical slot, for the conversion's counts; a problem of the
        list is a :class:`PlacementError` naming ``source``."""
        check_counts(n_logical, ep_size)
        if not isinstance(ids, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise PlacementError(f"{source}: expected a JSON list of integer logical expert ids, one per physical slot")
        if len(ids) > MAX_PHYSICAL_EXPERTS:
            raise PlacementError(f"{source}: {len(ids)} physical slots, at most {MAX_PHYSICAL_EXPERTS} supported")
        if (problem := slots_problem(n_logical, ep_size, ids)) is not None:
            raise PlacementError(f"{source}: {problem}")
        return cls(n_logical, ep_size, tuple(ids))

    @classmethod
    def from_file(cls, path: Path, n_logical: int, ep_size: int) -> "Placement":
        """Read ``[l0, l1, ...]`` or ``{"physical_to_logical": [...]}`` from a JSON file (see
        :meth:`read_file`; per-layer placements there are refused: only the converter checks them)."""
        placement, extra = cls.read_file(path, n_logical, ep_size)
        if extra.get("layer_placements"):
            raise PlacementError(f"{path}: layer_placements cannot be checked here; pass the file to `megamoe convert`")
        return placement

    @classmethod
    def read_file(cls, path: Path, n_logical: int, ep_size: int) -> tuple["Placement", dict[str, Any]]:
        """The placement of a JSON file, and its fields the caller must check against its own plan
        (``engine``, ``layer_placements``). An object may hold what ``megamoe plan --json`` prints
        (:data:`FILE_FIELDS`); every field but ``engines`` (information only) must agree with the
        conversion or the list (``"default": true`` beside a non-default list is refused), and an
        unknown field is refused: nothing in a placement file is ignored without a word."""
        data = jsonio.read(Path(path), PlacementError, "placement file", jsonio.MAX_PLACEMENT_BYTES)
        if not isinstance(data, dict):
            return cls.from_list(data, n_logical, ep_size, source=str(path)), {}
        f = jsonio.Fields(path, PlacementError)
        unknown = sorted(set(data) - set(FILE_FIELDS))
        if unknown:
            raise f.fail(f"unknown field {jsonio.short(unknown[0])} (a placement file holds {', '.join(FILE_FIELDS)})")
        for key, want in (("ep_size", ep_size), ("n_logical", n_logical)):
            if key in data and f.int(data, key, hi=MAX_PHYSICAL_EXPERTS) != want:
                raise f.fail(f"{key} is {data[key]}, but this conversion has {key}={want}")
        placement = cls.from_list(f.list(data, "physical_to_logical"), n_logical, ep_size, source=str(path))
        derived = placement.to_json()
        for key in ("num_redundant", "experts_per_rank", "default"):
            if key in data and (data[key] != derived[key] or type(data[key]) is not type(derived[key])):
                raise f.fail(f"{key} is {jsonio.short(data[key])}, but its physical_to_logical gives "
                             f"{jsonio.short(derived[key])}")
        extra: dict[str, Any] = {}
        if "engine" in data:
            extra["engine"] = f.str(data, "engine")
        if "layer_placements" in data:
            extra["layer_placements"] = {key: cls.from_json(value, f"{path}: layer_placements.{key}")
                                         for key, value in f.obj(data, "layer_placements").items()}
        return placement, extra

    # ---------------------------------------------------------------- queries
    @property
    def n_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_redundant(self) -> int:
        return self.n_physical - self.n_logical

    @property
    def experts_per_rank(self) -> int:
        return self.n_physical // self.ep_size

    def experts_start(self, rank: int) -> int:
        """First physical slot of ``rank`` (vLLM's ``experts_start_idx``)."""
        self.check_rank(rank)
        return rank * self.experts_per_rank

    def rank_logical_ids(self, rank: int) -> tuple[int, ...]:
        """Logical expert held by each local slot of ``rank``, in slot order."""
        start = self.experts_start(rank)
        return self.physical_to_logical[start:start + self.experts_per_rank]

    def check_rank(self, rank: int, where: str = "") -> None:
        """Refuse a rank this placement has not (``where`` leads the error: what asked for it)."""
        if not 0 <= rank < self.ep_size:
            raise PlacementError(f"{where}rank {rank} out of range for ep_size={self.ep_size} "
                                 f"(valid: 0..{self.ep_size - 1})")

    def is_default(self) -> bool:
        return self == Placement.default(self.n_logical, self.ep_size, self.num_redundant)

    def to_json(self) -> dict[str, Any]:
        return {"n_logical": self.n_logical, "ep_size": self.ep_size, "num_redundant": self.num_redundant,
                "experts_per_rank": self.experts_per_rank, "default": self.is_default(),
                "physical_to_logical": list(self.physical_to_logical)}

    @classmethod
    def from_json(cls, data: Any, where: object = "placement") -> "Placement":
        """:meth:`to_json`'s object, every field checked: the derived ones must agree with the list.
        A problem is a :class:`PlacementError` naming ``where`` (the file the object is read from)."""
        f = jsonio.Fields(where, PlacementError)
        f.obj(data, name="placement")
        ep_size = f.int(data, "ep_size", lo=1, hi=MAX_EP_SIZE, name="placement.ep_size")
        n_logical = f.int(data, "n_logical", lo=1, hi=MAX_PHYSICAL_EXPERTS, name="placement.n_logical")
        ids = f.ints(data, "physical_to_logical", name="placement.physical_to_logical", max_len=MAX_PHYSICAL_EXPERTS)
        if (problem := slots_problem(n_logical, ep_size, ids)) is not None:
            raise f.fail(f"placement: {problem}")
        placement = cls(n_logical, ep_size, tuple(ids))
        derived = placement.to_json()
        for key in ("num_redundant", "experts_per_rank", "default"):
            if key in data and (data[key] != derived[key] or type(data[key]) is not type(derived[key])):
                raise f.fail(f"placement.{key} is {jsonio.short(data[key])}, "
                             f"its physical_to_logical gives {derived[key]}")
        return placement


#: The fields a placement file may hold: what ``megamoe plan --json`` prints.
FILE_FIELDS = ("physical_to_logical", "ep_size", "n_logical", "num_redundant", "experts_per_rank", "default",
               "engine", "layer_placements", "engines")


def check_file_fields(extra: dict[str, Any], placement: Placement, engine: str, where: object,
                      layers: Sequence[tuple[str, bool, int]], mtp_like_decoder: bool = False) -> None:
    """A placement file's ``engine`` and ``layer_placements`` (:meth:`Placement.read_file`) must be
    what this conversion builds; ``layers``: ``(key, is_mtp, logical experts)`` of every MoE layer.
    The engine places the layers with an expert count of their own by its own rule: no file changes it."""
    if "engine" in extra and extra["engine"] != engine:
        raise PlacementError(f"{where}: planned for engine {jsonio.short(extra['engine'])}, but this conversion is "
                             f"for {engine!r}; pass --engine {jsonio.one_line(str(extra['engine']))}")
    if "layer_placements" not in extra:
        return
    own = {key: p for key, is_mtp, n in layers
           if (p := layer_placement(engine, placement, is_mtp, n, mtp_like_decoder)) != placement}
    given = extra["layer_placements"]
    for key in sorted(set(own) | set(given)):
        if given.get(key) != own.get(key):
            raise PlacementError(f"{where}: layer_placements.{jsonio.one_line(key)} is not the placement {engine} "
                                 f"builds that layer with ({'not listed' if key not in given else 'it differs'}); "
                                 "the engine's own rule places it: remove layer_placements, or print them with "
                                 "`megamoe plan --json`")


def layer_placement(engine: str, placement: Placement, is_mtp: bool, n_logical: int | None = None,
                    mtp_like_decoder: bool = False, where: str = "") -> Placement:
    """The placement ``engine`` builds one layer with, given the decoder layers' ``placement``
    and the layer's own logical expert count ``n_logical`` (``None``: the decoder layers');
    a layer it cannot build is a :class:`PlacementError` led by ``where`` (the layer's name).

    vLLM uses one placement for every layer of the decoder's expert count; a layer with its own
    (DeepSeek-V4.1's DSpark MTP layers) gets vLLM's default placement of that count with the
    same number of redundant experts (``DeepseekV4MoE._init_mega_moe_experts``). SGLang builds
    DeepSeek-V4's MTP (NextN) layer without expert location and without redundant experts: slot
    ``p`` holds logical ``p``; a family whose NextN layer SGLang builds like a decoder layer
    (``mtp_like_decoder``: DeepSeek-V3, GLM-4.5) gets the decoder layers' placement.
    """
    problem = layer_placement_problem(engine, placement, is_mtp, n_logical, mtp_like_decoder)
    if problem is not None:
        raise PlacementError(f"{where}{problem}")
    n_logical = placement.n_logical if n_logical is None else n_logical
    if n_logical != placement.n_logical and engine == "vllm":  # the default one, with the decoder's redundant
        return Placement.default(n_logical, placement.ep_size, placement.num_redundant)
    if engine != "sglang" or not is_mtp or mtp_like_decoder:
        return placement
    return Placement.default(n_logical, placement.ep_size)


def layer_placement_problem(engine: str, placement: Placement, is_mtp: bool, n_logical: int | None = None,
                            mtp_like_decoder: bool = False) -> str | None:
    """Why ``engine`` cannot build the layer (:func:`layer_placement`), or ``None``: for a caller that
    says more in the one error it raises (which layers do build, what to run instead)."""
    if engine not in ENGINES:
        return f"unknown engine {engine!r} (known: {', '.join(ENGINES)})"
    n_logical = placement.n_logical if n_logical is None else n_logical
    if n_logical != placement.n_logical and engine == "vllm":  # vLLM's own assertion would refuse these
        if not placement.is_default():
            return (f"an explicit placement lists the decoder layers' {placement.n_logical} experts, but "
                    f"vLLM builds the layers with {n_logical} experts of their own with its default one; "
                    "convert them with the default placement or leave them out (--layers)")
        n_physical = n_logical + placement.num_redundant
        if n_physical % placement.ep_size:
            return (f"vLLM builds the layers with {n_logical} experts of their own with "
                    f"{placement.num_redundant} redundant ones: {n_physical} physical experts are not "
                    f"divisible by ep_size={placement.ep_size}")
    elif engine == "sglang" and is_mtp and not mtp_like_decoder and n_logical % placement.ep_size:
        return (f"SGLang builds the MTP layer with {n_logical} experts and no redundant "
                f"ones, which do not divide over ep_size={placement.ep_size}")
    return None


def slots_problem(n_logical: int, ep_size: int, ids: Sequence[int]) -> str | None:
    """What makes ``ids`` (one logical expert per physical slot) no placement over ``ep_size`` ranks,
    or ``None``: the constructors that read a file check first, so their error names the file."""
    if ep_size <= 0:
        return f"ep_size must be positive, got {ep_size}"
    if len(ids) % ep_size:
        return (f"{len(ids)} physical experts do not divide over ep_size={ep_size} "
                f"(n_routed + num_redundant must be a multiple of the EP size)")
    bad = [x for x in ids if not 0 <= x < n_logical]
    if bad:
        return f"logical expert id {bad[0]} out of range [0, {n_logical})"
    missing = sorted(set(range(n_logical)) - set(ids))
    if missing:
        return (f"logical experts {missing[:8]}{'...' if len(missing) > 8 else ''} have no "
                f"physical slot ({len(missing)} of {n_logical} missing)")
    return None


def check_counts(n_logical: int, ep_size: int, num_redundant: int = 0) -> None:
    """Counts must be integers within bounds before anything is built from them."""
    if (problem := counts_problem(n_logical, ep_size, num_redundant)) is not None:
        raise PlacementError(problem)


def counts_problem(n_logical: int, ep_size: int, num_redundant: int = 0) -> str | None:
    """What makes the counts no integers within bounds (:func:`check_counts`), or ``None``."""
    for name, value, lo, hi in (("n_routed_experts", n_logical, 1, MAX_PHYSICAL_EXPERTS),
                                ("ep_size", ep_size, 1, MAX_EP_SIZE),
                                ("num_redundant_experts", num_redundant, 0, MAX_PHYSICAL_EXPERTS - n_logical)):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} must be an integer, got {value!r}"
        if not lo <= value <= max(lo, hi):
            return (f"{name}={value} is outside {lo}..{max(lo, hi)} "
                    f"(at most {MAX_PHYSICAL_EXPERTS} physical experts, ep_size at most {MAX_EP_SIZE})")
    return None


def default_problem(n_logical: int, ep_size: int, num_redundant: int = 0) -> str | None:
    """Why vLLM's default placement of these counts cannot be built (:meth:`Placement.default`),
    or ``None``: for a caller that says more in the one error it raises (the EP sizes that work)."""
    problem = counts_problem(n_logical, ep_size, num_redundant)
    if problem is None and (n_logical + num_redundant) % ep_size:
        problem = (f"n_routed_experts ({n_logical}) + num_redundant_experts ({num_redundant}) = "
                   f"{n_logical + num_redundant} is not divisible by ep_size={ep_size}")
    return problem




def parse_ranks(spec: str | None, ep_size: int, where: str = "") -> list[int]:
    """``"0,3-5"`` -> ``[0, 3, 4, 5]``; ``None`` -> every rank. Out-of-range ranks are errors
    (naming ``where``, the conversion the ranks are of, when given)."""
    check_counts(1, ep_size)
    if spec is None or spec.strip() in ("", "all"):
        return list(range(ep_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        first, last = parse_range(part.strip(), "--ranks", "0,3-5", ep_size - 1,
                                  context=f" for ep_size={ep_size}" + (f" ({where})" if where else ""))
        ranks.update(range(first, last + 1))
    return sorted(ranks)
