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
import random
import shlex
import time
from pathlib import Path
from typing import Callable, Sequence

from megamoe_convert.devices import usable_device
from megamoe_convert.errors import LoadError, ManifestError, PlacementError, UsageError
from megamoe_convert.layout.identity import identity_problems
from megamoe_convert.layout.placement import parse_ranks
from megamoe_convert.output import marker, ranged
from megamoe_convert.output.compare import (
    check_family,
    compare_extras,
    compare_non_expert,
    copied_family_problem,
    numerics_config,
)
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import MANIFEST_NAME, PART_GLOB, STATE_DIR, is_user_path
from megamoe_convert.output.writer import file_problems
from megamoe_convert.progress import NoProgress, Phases, Progress
from megamoe_convert.serve.load_checks import check_logical_ids, check_shard
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.safetensors_io import FileCache, SafetensorsError, read_header
from megamoe_convert.verify import deep_gemm as gemm_check
from megamoe_convert.verify.experts import compare_experts, expected_rank_layer, sample_slots
from megamoe_convert.verify.numerics import NUMERICS_MAX_EXPERTS, check_numerics, numerics_checks
from megamoe_convert.verify.report import Problem, VerifyReport

__all__ = ["NUMERICS_MAX_EXPERTS", "Problem", "VerifyReport", "expected_rank_layer", "numerics_checks",
           "refuse_non_conversion", "verify"]


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
    top (notes, a README) and the folders an engine writes into what it serves (``USER_DIRS``:
    SGLang's presharded dump) are the user's and are left alone."""
    listed = {f.path for f in manifest.files}
    found = [p for p in out.rglob("*") if p.is_file() and STATE_DIR not in p.relative_to(out).parts]
    for path in sorted(found):
        rel = path.relative_to(out).as_posix()
        if is_user_path(rel):
            continue
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
# Entry point
# --------------------------------------------------------------------------------------

def refuse_non_conversion(out: Path) -> None:
    """``verify`` pointed at a folder with no trace of a conversion (an unfinished one, or one whose
    manifest was lost, is reported as one): a source checkpoint, or any other folder, is a usage
    error in one line, not a list of problems."""
    if ((out / MANIFEST_NAME).exists() or (out / STATE_DIR).exists() or any(out.glob("rank-*"))
            or (out / "experts").exists() or any(out.glob(PART_GLOB))):
        return
    quoted = shlex.quote(str(out))
    if (out / "config.json").is_file() and (any(out.glob("*.safetensors.index.json"))
                                            or any(out.glob("*.safetensors"))):
        raise UsageError(f"{out} is a source checkpoint, not a conversion: `megamoe verify` checks what `megamoe "
                         f"convert` wrote (megamoe verify OUT --source {quoted}); `megamoe inspect {quoted}` shows "
                         "what a checkpoint holds")
    raise UsageError(f"{out} is neither a megamoe conversion (no {MANIFEST_NAME}) nor a checkpoint: `megamoe verify` "
                     "checks what `megamoe convert` wrote")


def verify(out: Path | str, *, source: Path | str | None = None, ranks: str | None = None, sample: int | None = None,
           numerics: bool = False, deep_gemm: bool = False, device: str = "cpu", seed: int = 0,
           progress: Progress | None = None, numerics_every_rank: bool = False,
           before_numerics: Callable[[], None] | None = None) -> VerifyReport:
    """Run the checks asked for; return a report (``report.ok`` when nothing is wrong).

    Raises :class:`ManifestError` when ``out`` is not a directory, :class:`DeviceError` (a
    ``ValueError``) for an unusable ``device``, and ``ValueError``
    when a check that compares with the source is asked for without ``source``: silently
    skipping a check someone asked for would read as a pass.
    """
    if source is None and (numerics or deep_gemm or sample is not None):
        raise UsageError("--numerics, --deep-gemm and --sample compare against the source checkpoint: pass --source")
    if sample is not None and sample < 1:
        raise ValueError(f"--sample {sample}: compare at least one expert slot")
    if numerics:
        usable_device(device, "--device")
    out = Path(out)
    started = time.perf_counter()
    report = VerifyReport(str(out))
    phases = Phases(progress or NoProgress(), report.phases)
    if not out.is_dir():
        raise ManifestError(f"{out}: no such directory")
    refuse_non_conversion(out)
    ckpt = Checkpoint.open(source) if source is not None else None  # a bad --source fails before any hashing
    if ckpt is not None and numerics:
        numerics_config(ckpt)  # a source whose numbers cannot be computed with: refused first too
    try:
        manifest = read_manifest(out)
    except (ManifestError, PlacementError) as e:  # no finished conversion, or one that contradicts itself
        for problem in e.problems if isinstance(e, ManifestError) else [str(e)]:
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
    # the recorded transform and fingerprints must be this code's
    report.problems += [Problem(MANIFEST_NAME, p) for p in identity_problems(manifest.layout_record(), manifest.dims)]
    report.count("layout identity")
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
                    if before_numerics is not None:  # once the source passed every earlier check
                        before_numerics()
                    phases.start(0, len(checks), description="verify: numerics", unit="layers", in_bytes=False)
                    check_numerics(out, manifest, ckpt, files, report, checks, device, seed, phases)
                if deep_gemm and gemm_check.deep_gemm_unavailable_reason() is None:
                    phases.start(0, len(slots), description="verify: deep gemm", unit="layers", in_bytes=False)
                if deep_gemm:
                    gemm_check.check_deep_gemm(out, manifest, ckpt, files, report, slots, phases)
    phases.end()
    report.seconds = time.perf_counter() - started
    return report
