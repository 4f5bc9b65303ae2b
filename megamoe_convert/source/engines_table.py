"""What each engine serves: the one table behind ``convert``, ``plan``, ``inspect``, the help text,
the serve commands and the engines' own checks, so no two of them can disagree.

One row per engine contract and shape rule, read off each release's own code:

=======  ==========  ===========================  =========  ==========================  ====================
engine   releases    contract                     GPUs       families                    weight formats
=======  ==========  ===========================  =========  ==========================  ====================
vLLM     0.30        finalize_weights (pads I)    Blackwell  DeepSeek-V4                 mxfp4
vLLM     0.31-0.32   finalize_weights             Blackwell  DeepSeek-V4                 mxfp4
vLLM     0.33        kernel-layout parameters     Blackwell  DeepSeek-V4, V4.1, Kimi-K3  mxfp4, mxfp8, nvfp4, bf16
SGLang   0.5.23      fp8.py MegaMoE (fp8 x fp4)   Blackwell  DeepSeek-V4                 mxfp4
SGLang   0.5.23      SM90 FP8 MegaMoE             Hopper     DeepSeek-V3/R1, Qwen3-MoE   fp8_block
=======  ==========  ===========================  =========  ==========================  ====================

Shape rules: vLLM's ``DeepGemmMegaMoEExperts`` and SGLang's SM90 build need hidden and intermediate
sizes that are multiples of 128; vLLM 0.30's ``finalize_weights`` pads the intermediate size to a
multiple of 512 (a layout no conversion holds); SGLang's fp8 x fp4 pre-dispatch needs 16-byte input
scale rows (``mega_moe.py: check_mega_moe_shapes``: hidden % 512). Placements: vLLM serves only its
default one (slot ``p`` holds ``p % n``), with EPLB's redundant experts except where a family's
layers are built without them; SGLang serves any (``--init-expert-location``).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from megamoe_convert.source.families import FAMILIES, ModelFamily, by_name

BLACKWELL, HOPPER = "Blackwell", "Hopper"


@dataclass(frozen=True)
class ServingRow:
    """One engine contract: the releases that run it, on which GPUs, for which families and formats."""

    engine: str
    releases: tuple[str, ...]
    contract: str
    gpu: str
    families: tuple[str, ...]
    formats: tuple[str, ...]
    #: (hidden_size multiple, moe_intermediate_size multiple).
    shape: tuple[int, int]


@dataclass(frozen=True)
class ServingEngine:
    """One serving engine: every release the tool knows, its placements and its serve command."""

    name: str
    title: str
    releases: tuple[str, ...]
    #: The command that serves a conversion: ``{path}`` shell-quoted, ``{n}`` the EP size.
    command: str
    #: What the command adds for ``{r}`` redundant experts (``{eplb}``: vLLM's EPLB config, quoted).
    redundant: str
    #: The engine serves an explicit placement (SGLang's ``--init-expert-location``); vLLM only its default.
    explicit_placement: bool
    #: Said beside every command.
    note: str = ""
    #: Families whose MegaMoE layers the engine builds without redundant or re-placed experts.
    fixed_experts: tuple[str, ...] = ()
    #: Flags the command needs for a family's conversion.
    flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Why the engine serves none of a family's conversions, where more than "it has no MegaMoE for it".
    refusals: Mapping[str, str] = field(default_factory=dict)


ENGINES: tuple[ServingEngine, ...] = (
    ServingEngine("vllm", "vLLM", ("0.30", "0.31", "0.32", "0.33"),
           "vllm serve {path} --load-format megamoe --data-parallel-size {n} --enable-expert-parallel "
           "--moe-backend deep_gemm_mega_moe", " --enable-eplb --eplb-config {eplb}", explicit_placement=False,
           note="one process per GPU (EP over data parallel)", fixed_experts=("kimi_k3",)),
    ServingEngine("sglang", "SGLang", ("0.5.23",),
           "python -m sglang.launch_server --model-path {path} --load-format megamoe --tp-size {n} --ep-size {n} "
           "--moe-a2a-backend megamoe", " --ep-num-redundant-experts {r}", explicit_placement=True,
           # SGLang fuses DeepSeek-V3's shared expert into the routed experts by default (deepseek_v2.py:
           # shared_experts_fusion_disable_reason), which the pre-baked routed slots do not hold.
           flags={"deepseek_v3": ("--disable-shared-experts-fusion",)},
           refusals={"deepseek_v41": "SGLang's DeepSeek-V4.1 model is not one megamoe-convert's SGLang contract is "
                                     "proven against",
                     "kimi_k3": "SGLang's Kimi-K3 MegaMoE path (mxfp4.py) rebuilds the experts whatever is installed",
                     "glm4_moe": "SGLang 0.5.23's Glm4MoeSparseMoeBlock never takes the MegaMoE forward"}),
)

_SM100 = ("mxfp4", "mxfp8", "nvfp4", "bf16")
ROWS: tuple[ServingRow, ...] = (
    ServingRow("vllm", ("0.30",), "finalize_weights (DeepseekV4MegaMoEExperts)", BLACKWELL, ("deepseek_v4",),
             ("mxfp4",), (128, 512)),
    ServingRow("vllm", ("0.31", "0.32"), "finalize_weights (DeepseekV4MegaMoEExperts)", BLACKWELL, ("deepseek_v4",),
             ("mxfp4",), (128, 128)),
    ServingRow("vllm", ("0.33",), "kernel-layout parameters (DeepGemmMegaMoEExperts)", BLACKWELL,
             ("deepseek_v4", "deepseek_v41", "kimi_k3"), _SM100, (128, 128)),
    ServingRow("sglang", ("0.5.23",), "fp8.py MegaMoE, fp8 x fp4 (build_mega_moe_experts_weights)", BLACKWELL,
             ("deepseek_v4",), ("mxfp4",), (512, 128)),
    ServingRow("sglang", ("0.5.23",), "SM90 FP8 MegaMoE (build_sm90_mega_moe_experts_weights)", HOPPER,
             ("deepseek_v3", "qwen3_moe"), ("fp8_block",), (128, 128)),
)

ENGINE_NAMES = tuple(e.name for e in ENGINES)


def engine(name: str) -> ServingEngine:
    """The engine called ``name`` (``vllm`` / ``sglang``)."""
    for e in ENGINES:
        if e.name == name:
            return e
    raise KeyError(name)


def rows(engine_name: str | None = None, family: str | None = None,
         weight_format: str | None = None) -> list[ServingRow]:
    """The rows of an engine, a family and a weight format (``None``: any)."""
    return [r for r in ROWS if engine_name in (None, r.engine) and (family is None or family in r.families)
            and (weight_format is None or weight_format in r.formats)]


def engines_for(family: ModelFamily) -> tuple[str, ...]:
    """The engines that serve some conversion of ``family``, in the table's order (the first: its default)."""
    return tuple(name for name in ENGINE_NAMES if rows(name, family.name))


def default_engine(family: ModelFamily) -> str | None:
    """The engine a conversion of ``family`` is made for when none is named (``None``: no engine serves it)."""
    served = engines_for(family)
    return served[0] if served else None


def resolve_engine(family: ModelFamily, engine_name: str | None) -> str:
    """The engine named, else the one that serves ``family``: a family only SGLang serves needs no
    ``--engine sglang`` (a family no engine serves: the first, whose refusal then says why)."""
    return engine_name or default_engine(family) or ENGINE_NAMES[0]


def family_titles() -> str:
    """The families some engine serves, for the help: ``DeepSeek-V4, ..., Qwen3-MoE``."""
    return ", ".join(f.title for f in FAMILIES if engines_for(f))


def engine_defaults() -> str:
    """Which engine each family's conversions default to, for ``--engine``'s help:
    ``vllm for DeepSeek-V4, ...; sglang for DeepSeek-V3 and Qwen3-MoE``."""
    by_engine: dict[str, list[str]] = {}
    for family in FAMILIES:
        if (name := default_engine(family)) is not None:
            by_engine.setdefault(name, []).append(family.title)
    return "; ".join(f"{name} for {_join(titles)}" for name, titles in by_engine.items())


def family_refusal(family: ModelFamily, engine_name: str) -> str | None:
    """Why ``engine_name`` serves no conversion of ``family``, or ``None`` when it serves some."""
    if rows(engine_name, family.name):
        return None
    e = engine(engine_name)
    if family.name in e.refusals:
        return e.refusals[family.name]
    served = sorted({f for r in rows(engine_name) for f in r.families}, key=_family_order)
    return (f"{e.title} {release_range(e, e.releases)} runs MegaMoE for "
            f"{_join([by_name(f).title for f in served])} only")


def unserved_note(family: ModelFamily) -> str:
    """Why no engine serves ``family``: every engine's reason."""
    return (f"no engine runs {family.title}'s MegaMoE yet: "
            + "; ".join(str(family_refusal(family, name)) for name in ENGINE_NAMES))


def problems(engine_name: str, family: ModelFamily, weight_format: str, hidden: int, intermediate: int) -> list[str]:
    """Why no release of ``engine_name`` serves a conversion of ``family`` in ``weight_format`` at these
    dims (empty: one does): the family, else the format, else each shape rule that every row breaks."""
    if (why := family_refusal(family, engine_name)) is not None:
        return [why]
    family_rows = rows(engine_name, family.name)
    fitting = [r for r in family_rows if weight_format in r.formats]
    if not fitting:
        taken = ", ".join(f"{'/'.join(r.formats)} on {r.gpu}" for r in family_rows)
        return [f"{engine(engine_name).title}'s MegaMoE takes {family.title} experts as {taken}, "
                f"these are {weight_format}"]
    if any(not _shape_problems(r, hidden, intermediate) for r in fitting):
        return []
    return sorted({p for r in fitting for p in _shape_problems(r, hidden, intermediate)})


def serving_rows(engine_name: str, family: ModelFamily, weight_format: str, hidden: int,
                 intermediate: int) -> list[ServingRow]:
    """The rows that serve a conversion of these numbers: family, weight format and shape rule."""
    return [r for r in rows(engine_name, family.name, weight_format) if not _shape_problems(r, hidden, intermediate)]


def _shape_problems(row: ServingRow, hidden: int, intermediate: int) -> list[str]:
    return [f"{name}={value} is not a multiple of {m}" for name, value, m in
            (("hidden_size", hidden, row.shape[0]), ("moe_intermediate_size", intermediate, row.shape[1]))
            if value % m]


def served_by(engine_name: str, family: ModelFamily, weight_format: str, hidden: int, intermediate: int) -> str:
    """``vLLM 0.31-0.33 on Blackwell``: the releases and GPUs that serve a conversion of these numbers,
    or the engine's title alone when none does."""
    e, fitting = engine(engine_name), serving_rows(engine_name, family, weight_format, hidden, intermediate)
    if not fitting:
        return e.title
    releases = [r for r in e.releases if any(r in row.releases for row in fitting)]
    return f"{e.title} {release_range(e, releases)} on {' or '.join(dict.fromkeys(r.gpu for r in fitting))}"


def release_range(e: ServingEngine, releases: Sequence[str]) -> str:
    """``0.30-0.33`` for consecutive releases of the engine, ``0.30, 0.33`` otherwise."""
    index = [e.releases.index(r) for r in releases]
    if len(index) > 1 and index == list(range(index[0], index[-1] + 1)):
        return f"{releases[0]}-{releases[-1]}"
    return ", ".join(releases)


def serve_command(engine_name: str, path: str, n: str, num_redundant: int, family: str) -> str:
    """The command that serves ``path`` (shell-quoted) with ``engine_name`` at EP size ``n`` (a number,
    or ``N``) with ``num_redundant`` redundant experts, and the flags ``family``'s conversion needs."""
    e = engine(engine_name)
    command = e.command.format(path=path, n=n)
    if num_redundant:
        eplb = shlex.quote(json.dumps({"num_redundant_experts": num_redundant}))
        command += e.redundant.format(r=num_redundant, eplb=eplb)
    return command + "".join(f" {flag}" for flag in e.flags.get(family, ()))


def support_matrix() -> str:
    """The whole table in one sentence, for the help: per engine, its releases, families and GPUs."""
    parts = []
    for e in ENGINES:
        by_gpu: dict[str, list[str]] = {}
        for row in rows(e.name):
            by_gpu.setdefault(row.gpu, []).extend(f for f in row.families if f not in by_gpu.get(row.gpu, []))
        served = ", ".join(f"{_titles(e, names)} on {gpu}" for gpu, names in by_gpu.items())
        parts.append(f"{e.title} {release_range(e, e.releases)}: {served}")
    return "; ".join(parts)


def _titles(e: ServingEngine, names: Sequence[str]) -> str:
    """The families' titles, each group followed by the releases that serve it where the engine has
    several: ``DeepSeek-V4 (0.30-0.33), DeepSeek-V4.1 and Kimi-K3 (0.33)``."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names, key=_family_order):
        releases = [r for r in e.releases if any(r in row.releases for row in rows(e.name, name))]
        groups.setdefault(release_range(e, releases), []).append(by_name(name).title)
    if len(e.releases) == 1:
        return _join([title for titles in groups.values() for title in titles])
    return ", ".join(f"{_join(titles)} ({releases})" for releases, titles in groups.items())


def _family_order(name: str) -> int:
    return [f.name for f in FAMILIES].index(name)


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
