"""``megamoe verify``: prove a converted directory is complete, intact, laid out right, and
computes what its source computes.

Four levels, each optional beyond the first:

1. structure and integrity: the manifest, every file's size and xxh3-128 checksum, every
   rank shard's tensors (names, dtypes, shapes), and the logical experts each shard says it
   holds against the manifest's placement;
2. ``source``: every (or a random sample of) expert slot re-derived from the source
   checkpoint and compared byte for byte; non-expert tensors and small files (config.json marked) too;
3. ``numerics``: a reference SwiGLU MoE computed from the pre-baked layout (inverse layout +
   the format's dequantisation, ``formats.dequantize``) equals the one computed from the
   source's ``w1/w2/w3``, for every weight format; so does the pre-baked fused shared expert;
4. ``deep_gemm``: DeepGEMM's own transform (SM100 only) compared with the shards.

Problems are collected, not raised: a report lists everything that is wrong.
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from megamoe_convert import layout
from megamoe_convert.convert.gather import ExpertReader
from megamoe_convert.devices import usable_device
from megamoe_convert.errors import LoadError, ManifestError, MegamoeError, UsageError
from megamoe_convert.layout import KernelWeights
from megamoe_convert.output import marker, ranged
from megamoe_convert.output.compare import (
    check_family,
    compare_extras,
    compare_non_expert,
    copied_family_problem,
    numerics_config,
    same_values,
)
from megamoe_convert.output.layout_identity import NOT_RECORDED, identity_problems
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import MANIFEST_NAME, PART_GLOB, STATE_DIR
from megamoe_convert.output.writer import file_problems
from megamoe_convert.placement import parse_ranks
from megamoe_convert.progress import NoProgress, Phases, Progress
from megamoe_convert.serve.loader import check_logical_ids, check_shard, load_rank
from megamoe_convert.source import formats
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import FileCache, SafetensorsError, read_header


@dataclass
class Problem:
    where: str  # file, or "rank R layer L slot S", or tensor name
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclass
class VerifyReport:
    out: str
    problems: list[Problem] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    numerics: dict[str, Any] | None = None
    bytes_hashed: int = 0
    seconds: float = 0.0
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)  # each phase: unit, count, bytes, seconds
    coverage: dict[str, Any] | None = None  # what the conversion holds (Manifest.coverage)

    @property
    def ok(self) -> bool:
        return not self.problems

    def count(self, check: str, n: int = 1) -> None:
        self.checks[check] = self.checks.get(check, 0) + n

    def problem(self, where: str, what: str) -> None:
        self.problems.append(Problem(where, what))

    def to_json(self) -> dict[str, Any]:
        hashing = self.phases.get("hash", {}).get("seconds", 0.0)
        return {"out": str(Path(self.out).resolve()), "ok": self.ok,
                "servable": self.ok and bool(self.coverage and self.coverage["servable"]),
                "partial": bool(self.coverage and self.coverage["partial"]), "coverage": self.coverage,
                "problems": [str(p) for p in self.problems],
                "checks": {k.replace(" ", "_").replace("-", "_"): v for k, v in self.checks.items()},
                "skipped": self.skipped, "numerics": self.numerics, "bytes_hashed": self.bytes_hashed,
                "seconds": round(self.seconds, 3), "phases": self.phases,
                "hash_gb_per_s": round(self.bytes_hashed / hashing / 1e9, 3) if hashing > 0 else 0.0}


#: Local expert slots per rank and layer that ``--numerics`` runs: dequantised matrices are large and
#: every slot goes through the same layout code (``--source`` compares every slot's bytes), so the
#: rank's first and last slot, its edges, stand for the rest.
NUMERICS_MAX_EXPERTS = 2


def numerics_slots(n_local: int, max_experts: int, generator: torch.Generator) -> list[int]:
    """The local slots a numerics check runs: the first and the last, then random others up to ``max_experts``."""
    edges = sorted({0, n_local - 1})[:max_experts]
    others = [s for s in torch.randperm(n_local, generator=generator).tolist() if s not in edges]
    return sorted(edges + others[:max(0, max_experts - len(edges))])


# --------------------------------------------------------------------------------------
# 1. structure and integrity
# --------------------------------------------------------------------------------------

def check_files(out: Path, manifest: Manifest, report: VerifyReport, ranks: Sequence[int],
                progress: Progress) -> None:
    """Every listed file (of the chosen ranks) present, with its size and checksum (files checked
    on several threads, reported in manifest order)."""
    wanted_rank_files = {manifest.expert_file(layer, r) for r in ranks for layer in manifest.layers}
    listed = {f.path for f in manifest.files}
    for path in sorted(wanted_rank_files - listed):
        report.problem(path, "missing from manifest.json")
    records = [r for r in manifest.files if "/" not in r.path or r.path in wanted_rank_files]
    checks = [(out / record.path, record) for record in records]
    progress.start(sum(r.size for r in records), len(records), description="verify: hash", unit="files")
    for record, problem in zip(records, file_problems(checks, "manifest.json", checksum=True), strict=True):
        report.count("files")
        if problem:
            report.problem(record.path, problem)
        else:
            report.bytes_hashed += record.size
        progress.advance(record.size, record.path, False)


def check_unlisted_files(out: Path, manifest: Manifest, report: VerifyReport) -> None:
    """Weight files the manifest does not list: left by another conversion, or put there by hand.
    A reader globbing ``*.safetensors`` or a rank folder would pick them up. Other files at the
    top (notes, a README) are the user's and are left alone."""
    listed = {f.path for f in manifest.files}
    found = [p for p in out.rglob("*") if p.is_file() and STATE_DIR not in p.relative_to(out).parts]
    for path in sorted(found):
        rel = path.relative_to(out).as_posix()
        in_rank_dir = "/" in rel and rel.startswith(("rank-", "experts/"))
        if rel not in listed and (in_rank_dir or rel.endswith(".safetensors")) and not path.name.startswith("."):
            report.problem(rel, "not listed in manifest.json (left by another conversion?)")


def check_marker(out: Path, report: VerifyReport) -> None:
    """``config.json`` carries the serving marker (``output/marker.py``; a missing file: ``check_files``)."""
    with contextlib.suppress(FileNotFoundError):
        problem = marker.problem((out / "config.json").read_bytes())
        report.problem("config.json", problem) if problem else report.count("marker")


def compare_small_files(out: Path, ckpt: Checkpoint, report: VerifyReport) -> None:
    for name, problem in marker.small_file_problems(out, ckpt.small_files()):
        report.problem(name, problem) if problem else report.count("small files vs source")


def check_rank_shards(out: Path, manifest: Manifest, report: VerifyReport, ranks: Sequence[int]) -> None:
    """Tensors of every rank shard, and the logical experts it says it holds."""
    for rank in ranks:
        for layer in manifest.layers:
            path = out / manifest.expert_file(layer, rank)
            try:
                if not path.is_file():
                    continue  # already reported by check_files
                entries = check_shard(read_header(path), manifest, layer, rank)
                check_logical_ids(path, entries["logical_ids"],
                                  manifest.placement_for(layer).rank_logical_ids(rank))
                report.count("rank shards")
            except (LoadError, SafetensorsError, OSError) as e:
                why = f"cannot be read ({e.strerror})" if isinstance(e, OSError) and e.strerror else str(e)
                report.problem(path.relative_to(out).as_posix(), why.removeprefix(f"{path}: "))


# --------------------------------------------------------------------------------------
# 2. against the source
# --------------------------------------------------------------------------------------

def expected_rank_layer(ckpt: Checkpoint, files: FileCache, layer: MoELayer, logical_ids: Sequence[int],
                        device: str = "cpu") -> tuple[KernelWeights, KernelWeights]:
    """The layout of these experts computed directly from the source, as finalize_weights would
    (scales ``None`` for an unscaled format)."""
    reader = ExpertReader(ckpt, files, device)
    scaled = ckpt.dims.format.scaled
    if ckpt.dims.format.kernel == "sm90":  # SGLang's FP8 layout: only the L1 weight's rows move
        return layout.sm90_transform_experts(reader.stacked(layer, logical_ids, ("w1", "w3"), "weight"),
                                             reader.fp32_scales(layer, logical_ids, ("w1", "w3")),
                                             reader.stacked(layer, logical_ids, ("w2",), "weight"),
                                             reader.fp32_scales(layer, logical_ids, ("w2",)))
    if ckpt.dims.weight_format == "mxfp4":  # the whole transform, with its checks
        return layout.transform_experts(reader.stacked(layer, logical_ids, ("w1", "w3"), "weight"),
                                        reader.stacked(layer, logical_ids, ("w1", "w3"), "scale"),
                                        reader.stacked(layer, logical_ids, ("w2",), "weight"),
                                        reader.stacked(layer, logical_ids, ("w2",), "scale"))
    return (KernelWeights(layout.l1_weight(reader.stacked(layer, logical_ids, ("w1", "w3"), "weight")),
                          layout.l1_sf(reader.stacked(layer, logical_ids, ("w1", "w3"), "scale")) if scaled else None),
            KernelWeights(layout.l2_weight(reader.stacked(layer, logical_ids, ("w2",), "weight")),
                          layout.l2_sf(reader.stacked(layer, logical_ids, ("w2",), "scale")) if scaled else None))


def sample_slots(manifest: Manifest, ranks: Sequence[int], sample: int | None,
                 rng: random.Random) -> dict[tuple[int, MoELayer], list[int]]:
    """``(rank, layer) -> local slots`` to compare: all of them, or ``sample`` picked at random."""
    every = [(r, layer, s) for r in ranks for layer in manifest.layers
             for s in range(manifest.placement_for(layer).experts_per_rank)]
    chosen = every if sample is None or sample >= len(every) else rng.sample(every, sample)
    slots: dict[tuple[int, MoELayer], list[int]] = {}
    for r, layer, s in sorted(chosen, key=lambda x: (x[1], x[0], x[2])):
        slots.setdefault((r, layer), []).append(s)
    return slots


def load_layer(out: Path, rank: int, layer: MoELayer, report: VerifyReport) -> Any:
    """One rank's layer, or None (with the reason recorded) when it cannot be loaded."""
    try:
        return load_rank(out, rank, layers=[layer.key])[layer.prefix]
    except MegamoeError as e:
        report.problem(f"rank {rank} {layer.key}", f"cannot be loaded: {e}")
        return None


def compare_experts(out: Path, manifest: Manifest, ckpt: Checkpoint, files: FileCache, report: VerifyReport,
                    slots: dict[tuple[int, MoELayer], list[int]], progress: Progress) -> None:
    names = ("l1.weight", "l1.sf", "l2.weight", "l2.sf")
    for (rank, layer), local in slots.items():
        progress.advance(len(local) * manifest.dims.bytes_per_expert(), f"experts: rank {rank} {layer.key}", False)
        loaded = load_layer(out, rank, layer, report)
        if loaded is None:
            continue
        ids = [manifest.placement_for(layer).rank_logical_ids(rank)[s] for s in local]
        want = expected_rank_layer(ckpt, files, layer, ids)
        got = (*loaded.l1, *loaded.l2)
        for i, slot in enumerate(local):
            for name, g, w in zip(names, got, (*want[0], *want[1]), strict=True):
                if g is None:  # an unscaled format's scales
                    continue
                assert w is not None  # the source's layout holds every tensor the rank file does
                if not torch.equal(g[slot].reshape(-1).view(torch.uint8), w[i].reshape(-1).view(torch.uint8)):
                    report.problem(f"rank {rank} {layer.key} slot {slot}",
                                   f"{name} differs from logical expert {ids[i]} of the source")
        report.count("expert slots vs source", len(local))


# --------------------------------------------------------------------------------------
# 3. numerics
# --------------------------------------------------------------------------------------

#: ``activation(gate, up)``: the routed experts' gated activation, before the down projection.
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_activation(ckpt: Checkpoint) -> tuple[Activation, dict[str, Any]]:
    """The family's routed-expert activation with its config.json parameters (and those, for the report).

    - ``swiglu`` (DeepSeek): as vLLM's ``SiluAndMulWithClamp`` / DeepGEMM's ``activation_clamp``,
      the gate clamped from above and the up projection on both sides by ``swiglu_limit``, then
      ``silu(gate) * up``.
    - ``situ`` (Kimi-K3): as vLLM's ``SituAndMul``, ``beta * tanh(gate / beta) * sigmoid(gate)``
      times ``up``, softly clipped to ``linear_beta * tanh(up / linear_beta)`` when that is set.
    """
    config = numerics_config(ckpt)  # checked numbers, or a one-line CheckpointError
    if config.activation == "situ":
        beta, linear = config.situ_beta, config.situ_linear_beta

        def situ(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            up = linear * torch.tanh(up / linear) if linear else up
            return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up

        return situ, {"activation": "situ", "situ_beta": beta, "situ_linear_beta": linear}
    limit = config.swiglu_limit

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return torch.nn.functional.silu(gate) * up

    return swiglu, {"activation": "swiglu", "swiglu_limit": limit}


def gated_mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, activation: Activation,
              ) -> torch.Tensor:
    """One expert (routed or shared): ``activation(x @ w1.T, x @ w3.T) @ w2.T``."""
    return activation(x @ w1.T, x @ w3.T) @ w2.T


def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  activation: Activation) -> torch.Tensor:
    """``y = sum_k weight_k * expert_{id_k}(x)`` over the routed experts, token by token group,
    each expert ``activation(x @ w1.T, x @ w3.T) @ w2.T``."""
    y = torch.zeros_like(x)
    for e, (w1, w3, w2) in enumerate(experts):
        rows, k = (topk_ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y.index_add_(0, rows, topk_weights[rows, k, None] * gated_mlp(x[rows], w1, w3, w2, activation))
    return y


def _source_experts(ckpt: Checkpoint, files: FileCache, layer: MoELayer, logical_ids: Sequence[int],
                    ) -> list[tuple[torch.Tensor, ...]]:
    """``(w1, w3, w2)`` float32 matrices of each logical expert, dequantised from the source."""
    fmt = ckpt.dims.format

    def matrix(lid: int, proj: str) -> torch.Tensor:
        read = lambda kind: files.read(ckpt.expert_entry(layer, lid, proj, kind))  # noqa: E731
        entry = ckpt.expert_entry(layer, lid, proj, "scale") if fmt.scaled else None  # FP32 values: any float dtype
        scale = (formats.fp32_block_scales(read("scale"), entry.dtype) if fmt.scale_encoding == "fp32" else
                 read("scale")) if entry is not None else None
        global_scale = read(formats.WEIGHT_GLOBAL_SCALE).view(torch.float32).reshape(()) if fmt.global_scales else None
        return formats.dequantize(fmt, read("weight"), scale, global_scale)

    return [tuple(matrix(lid, p) for p in ("w1", "w3", "w2")) for lid in logical_ids]


def _layout_experts(fmt: formats.WeightFormat, loaded: Any, slots: list[int], hidden: int, inter: int,
                    ) -> list[tuple[torch.Tensor, ...]]:
    """``(w1, w3, w2)`` of the chosen local slots, dequantised from the pre-baked kernel form."""
    pick = lambda t: None if t is None else t[slots]  # noqa: E731
    d13 = formats.dequantize_kernel(fmt, loaded.l1.weight[slots], pick(loaded.l1.sf), hidden, True,
                                    pick(loaded.tensors.get("l1_global_scale")))
    d2 = formats.dequantize_kernel(fmt, loaded.l2.weight[slots], pick(loaded.l2.sf), inter, False,
                                   pick(loaded.tensors.get("l2_global_scale")))
    return [(d13[e, :inter], d13[e, inter:], d2[e]) for e in range(len(slots))]


def _shared_from_layout(loaded: Any, hidden: int, shared: int) -> tuple[torch.Tensor, ...]:
    (l1w, l1sf), (l2w, l2sf) = loaded.shared
    fmt = formats.SHARED_FORMAT
    d13 = formats.dequantize_kernel(fmt, l1w.unsqueeze(0), l1sf.unsqueeze(0), hidden, True)[0]
    d2 = formats.dequantize_kernel(fmt, l2w.unsqueeze(0), l2sf.unsqueeze(0), shared, False)[0]
    return d13[:shared], d13[shared:], d2


def _shared_from_source(ckpt: Checkpoint, files: FileCache, layer: MoELayer) -> tuple[torch.Tensor, ...]:
    read = lambda proj, kind: files.read(ckpt.shared_entry(layer, proj, kind))  # noqa: E731
    return tuple(formats.dequantize_blocks(formats.SHARED_FORMAT, read(p, "weight"), read(p, "scale"))
                 for p in ("w1", "w3", "w2"))


def numerics_checks(ranks: Sequence[int], layers: Sequence[MoELayer], every_rank: bool = False,
                    ) -> list[tuple[int, MoELayer]]:
    """The (rank, layer) pairs ``--numerics`` runs. By default every MoE layer once, the ranks taking
    turns (each rank at least once): the layout code is the same for every rank, and ``--source``
    already compares every slot's bytes, so a check per rank and layer adds time, not coverage
    (``every_rank``: all of them)."""
    if every_rank or not ranks or not layers:
        return [(rank, layer) for rank in ranks for layer in layers]
    return [(ranks[i % len(ranks)], layers[i % len(layers)]) for i in range(max(len(ranks), len(layers)))]


def check_numerics(out: Path, manifest: Manifest, ckpt: Checkpoint, files: FileCache, report: VerifyReport,
                   checks: Sequence[tuple[int, MoELayer]], device: str, seed: int, progress: Progress,
                   tokens: int = 32, max_experts: int = NUMERICS_MAX_EXPERTS) -> None:
    """Pre-baked layout and source checkpoint must give bit-identical MoE outputs.

    Per rank and layer of ``checks`` (:func:`numerics_checks`), tokens are routed top-k over up to
    ``max_experts`` local slots (:func:`numerics_slots`: dequantised matrices are large);
    the pre-baked shared expert, where there is one, runs on the same tokens.
    """
    activation, activation_report = expert_activation(ckpt)
    scale = numerics_config(ckpt).routed_scaling_factor
    top_k = min(ckpt.top_k(), manifest.placement.experts_per_rank)
    g = torch.Generator().manual_seed(seed)
    hidden, inter = manifest.dims.hidden_size, manifest.dims.moe_intermediate_size
    worst = {"max_abs_err": 0.0, "max_rel_err": 0.0, "layers": 0, "shared_experts": 0, "tokens": tokens,
             "top_k": top_k, **activation_report, "routed_scaling_factor": scale, "device": device,
             "weight_format": manifest.dims.weight_format}
    moved = lambda ws: [tuple(w.to(device).contiguous() for w in t) for t in ws]  # noqa: E731

    def compare(where: str, what: str, y_layout: torch.Tensor, y_source: torch.Tensor) -> None:
        diff = (y_layout - y_source).abs().nan_to_num(0.0)  # NaN where both are NaN (or inf) alike
        worst["max_abs_err"] = max(worst["max_abs_err"], float(diff.max()))
        worst["max_rel_err"] = max(worst["max_rel_err"], float((diff / y_source.abs().clamp_min(1e-30)).max()))
        if not same_values(y_layout, y_source):
            report.problem(where, f"{what} from the pre-baked layout differs from the source "
                                  f"(max abs err {float(diff.max()):.3g})")

    for rank, layer in checks:
        experts = min(max_experts, manifest.placement_for(layer).experts_per_rank)
        progress.advance(experts * manifest.dims.bytes_per_expert(),
                         f"numerics: rank {rank} {layer.key}", False)
        loaded = load_layer(out, rank, layer, report)
        if loaded is None:
            continue
        slots = numerics_slots(loaded.num_local_experts, max_experts, g)
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).float()
        scores = torch.randn(tokens, len(slots), generator=g)
        weights, ids = scores.softmax(-1).topk(min(top_k, len(slots)), dim=-1)
        args = (x.to(device), ids.to(device), weights.to(device) * scale)
        from_source = _source_experts(ckpt, files, layer, [loaded.logical_ids[s] for s in slots])
        compare(f"rank {rank} {layer.key}", "MoE output",
                reference_moe(*args, moved(_layout_experts(manifest.dims.format, loaded, slots, hidden, inter)),
                              activation).cpu(),
                reference_moe(*args, moved(from_source), activation).cpu())
        worst["layers"] += 1
        if loaded.shared is not None:
            shared = manifest.dims.shared_intermediate_size
            layout_out, source_out = (gated_mlp(args[0], w1, w3, w2, activation).cpu()
                                      for w1, w3, w2 in moved([_shared_from_layout(loaded, hidden, shared),
                                                               _shared_from_source(ckpt, files, layer)]))
            compare(f"rank {rank} {layer.key}", "shared expert output", layout_out, source_out)
            worst["shared_experts"] += 1
    report.numerics = worst
    report.count("numerics layers", worst["layers"])


# --------------------------------------------------------------------------------------
# 4. DeepGEMM cross-check
# --------------------------------------------------------------------------------------

#: DeepGEMM's layout functions run on the GPU (tests point this at the CPU with a stand-in).
DEEP_GEMM_DEVICE = "cuda"


def deep_gemm_unavailable_reason() -> str | None:
    if importlib.util.find_spec("deep_gemm") is None:
        return "deep_gemm is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return f"DeepGEMM's MegaMoE layout functions need an SM100 GPU; this GPU is SM{major}{minor}"
    return None


def deep_gemm_layout(w13: torch.Tensor, w13_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor):
    """What vLLM's ``finalize_weights`` computes, with DeepGEMM itself (SM100 only)."""
    import deep_gemm

    experts, two_i, half_h = w13.shape
    hidden, inter = half_h * 2, two_i // 2
    sf13 = deep_gemm.transform_sf_into_required_layout(layout.widen_ue8m0_to_fp32(w13_sf), two_i, hidden,
                                                       (1, 32), experts)
    sf2 = deep_gemm.transform_sf_into_required_layout(layout.widen_ue8m0_to_fp32(w2_sf), hidden, inter,
                                                      (1, 32), experts)
    return deep_gemm.transform_weights_for_mega_moe((w13.view(torch.int8), sf13), (w2.view(torch.int8), sf2))


def check_deep_gemm(out: Path, manifest: Manifest, ckpt: Checkpoint, files: FileCache, report: VerifyReport,
                    slots: dict[tuple[int, MoELayer], list[int]], progress: Progress) -> None:
    reason = deep_gemm_unavailable_reason()
    if manifest.dims.weight_format != "mxfp4":
        reason = f"DeepGEMM's fp8_fp4 transform takes MXFP4 only; these are {manifest.dims.weight_format} experts"
    if reason:
        report.skipped["deep_gemm"] = reason
        return
    for (rank, layer) in slots:
        ids = manifest.placement_for(layer).rank_logical_ids(rank)
        progress.advance(len(ids) * manifest.dims.bytes_per_expert(), f"deep_gemm: rank {rank} {layer.key}", False)
        reader = ExpertReader(ckpt, files, DEEP_GEMM_DEVICE)
        theirs = deep_gemm_layout(reader.stacked(layer, ids, ("w1", "w3"), "weight"),
                                  reader.stacked(layer, ids, ("w1", "w3"), "scale"),
                                  reader.stacked(layer, ids, ("w2",), "weight"),
                                  reader.stacked(layer, ids, ("w2",), "scale"))
        ours = load_layer(out, rank, layer, report)
        if ours is None:
            continue
        for name, a, b in zip(("l1.weight", "l1.sf", "l2.weight", "l2.sf"), (*ours.l1, *ours.l2),
                              (*theirs[0], *theirs[1]), strict=True):
            if a.shape != b.shape or a.stride() != b.stride() or not torch.equal(a, b.cpu()):
                report.problem(f"rank {rank} {layer.key}", f"{name} differs from deep_gemm's own transform")
        report.count("layers vs deep_gemm")


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------

def refuse_source_checkpoint(out: Path) -> None:
    """``verify`` pointed at a source checkpoint (a model's config and safetensors weights, no trace of a
    conversion: an unfinished one is reported as one) is a usage error, not a list of problems."""
    if ((out / MANIFEST_NAME).exists() or (out / STATE_DIR).exists() or any(out.glob("rank-*"))
            or any(out.glob(PART_GLOB)) or not (out / "config.json").is_file()):
        return
    if any(out.glob("*.safetensors.index.json")) or any(out.glob("*.safetensors")):
        raise UsageError(f"{out} is a source checkpoint, not a conversion: `megamoe verify` checks what `megamoe "
                         f"convert` wrote (megamoe verify OUT --source {out}); `megamoe inspect {out}` shows what a "
                         "checkpoint holds")


def verify(out: Path | str, *, source: Path | str | None = None, ranks: str | None = None, sample: int | None = None,
           numerics: bool = False, deep_gemm: bool = False, device: str = "cpu", seed: int = 0,
           progress: Progress | None = None, numerics_every_rank: bool = False) -> VerifyReport:
    """Run the checks asked for; return a report (``report.ok`` when nothing is wrong).

    Raises :class:`ManifestError` when ``out`` is not a directory, :class:`DeviceError` (a
    ``ValueError``) for an unusable ``device``, and ``ValueError``
    when a check that compares with the source is asked for without ``source``: silently
    skipping a check someone asked for would read as a pass.
    """
    if source is None and (numerics or deep_gemm or sample is not None):
        raise ValueError("--numerics, --deep-gemm and --sample compare against the source checkpoint: pass --source")
    if sample is not None and sample < 1:
        raise ValueError(f"--sample {sample}: compare at least one expert slot")
    if numerics:
        usable_device(device)
    out = Path(out)
    started = time.perf_counter()
    report = VerifyReport(str(out))
    phases = Phases(progress or NoProgress(), report.phases)
    if not out.is_dir():
        raise ManifestError(f"{out}: no such directory")
    refuse_source_checkpoint(out)
    ckpt = Checkpoint.open(source) if source is not None else None  # a bad --source fails before any hashing
    if ckpt is not None and numerics:
        numerics_config(ckpt)  # a source whose numbers cannot be computed with: refused first too
    try:
        manifest = read_manifest(out)
    except ManifestError as e:  # not (or no longer) a finished conversion, or one that contradicts itself
        for problem in e.problems:
            report.problem(MANIFEST_NAME, problem.removeprefix(f"{out / MANIFEST_NAME}: ").removeprefix(f"{out}: "))
        return report
    chosen = manifest.ranks if ranks is None else parse_ranks(ranks, manifest.ep_size)  # default: what was converted
    missing = [r for r in chosen if r not in manifest.ranks]
    for r in missing:
        report.problem(f"rank {r}", f"not converted (manifest lists ranks {manifest.ranks})")
    chosen = [r for r in chosen if r in manifest.ranks]
    report.coverage = manifest.coverage()
    if record_problem := ranged.record_problem(out):  # holes are no conversion's bytes
        report.problem(str(ranged.record_path(out).relative_to(out)), record_problem)
    check_files(out, manifest, report, chosen, phases)
    if family_problem := copied_family_problem(out, manifest):  # install names layers by the family
        report.problem(MANIFEST_NAME, family_problem)
    check_unlisted_files(out, manifest, report)
    if manifest.layout is None:
        report.skipped["layout identity"] = NOT_RECORDED
    else:  # the recorded transform and fingerprints must be what this code writes
        report.count("layout identity")
        report.problems += [Problem(MANIFEST_NAME, p) for p in identity_problems(manifest.layout, manifest.dims)]
    check_marker(out, report)
    check_rank_shards(out, manifest, report, chosen)
    if ckpt is not None:
        check_family(manifest, ckpt, report)
        if ckpt.dims != manifest.dims:
            report.problem("manifest.json", f"dims {manifest.dims} differ from the source's {ckpt.dims}")
        else:
            slots = sample_slots(manifest, chosen, sample, random.Random(seed))
            compare_small_files(out, ckpt, report)
            with FileCache() as files:
                steps = [len(local) * manifest.dims.bytes_per_expert() for local in slots.values()]
                steps += [] if manifest.experts_only else [e.nbytes for e in ckpt.non_expert_tensors()]
                phases.start(sum(steps), len(steps), description="verify: compare source", unit="steps")
                compare_experts(out, manifest, ckpt, files, report, slots, phases)
                compare_extras(out, manifest, ckpt, files, report, slots)
                if not manifest.experts_only:
                    compare_non_expert(out, ckpt, files, report, phases)
                if numerics:
                    checks = numerics_checks(chosen, manifest.layers, numerics_every_rank)
                    phases.start(0, len(checks), description="verify: numerics", unit="layers", in_bytes=False)
                    check_numerics(out, manifest, ckpt, files, report, checks, device, seed, phases)
                if deep_gemm and deep_gemm_unavailable_reason() is None:
                    phases.start(0, len(slots), description="verify: deep gemm", unit="layers", in_bytes=False)
                if deep_gemm:
                    check_deep_gemm(out, manifest, ckpt, files, report, slots, phases)
    phases.end()
    report.seconds = time.perf_counter() - started
    return report
