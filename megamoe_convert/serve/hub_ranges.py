"""``megamoe pull REPO --ep-size N --ranks 0-7``: just the byte ranges a node's ranks read of a store.

A store on the hub is one file per MoE layer holding every logical expert once, so a node's ranks
need a few ranges of each file: their slots' expert blocks of each per-slot tensor (one range per
run of consecutive logical experts, redundant slots sharing their expert's), the per-layer tensors
(fused shared expert, NVFP4's ``l2_input_scale_all``) once, and the header. Those ranges (the
union over the node's ranks, sorted and merged; gaps between them merged too, smallest first, while
the bytes fetched stay within 5% over the bytes needed) are fetched with HTTP range requests
(``huggingface_hub.HfFileSystem``, pinned to the manifest's commit) and written at their offsets of
a sparse local copy of each file, which then serves those ranks like the full store
(:func:`.store.load_slots` reads only ranges it has). The manifest, small files and non-expert
shards come through the ordinary pull (:func:`.hub.pull`, checksummed).

What is checked: each header byte for byte against the one the manifest's dims give (the writer's
own), every range's length, the file sizes. A whole file's checksum needs the whole file: a ranged
pull records what it fetched in ``OUT/.megamoe/ranges.json``, and loading refuses any read outside it.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import huggingface_hub

from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import STATE_DIR
from megamoe_convert.output.shards import rank_shard_specs, store_metadata
from megamoe_convert.output.writer import partial_path
from megamoe_convert.placement import Placement, PlacementError, layer_placement, parse_ranks
from megamoe_convert.serve import store
from megamoe_convert.serve.hub import HubError, _hub_errors, pull
from megamoe_convert.source import families
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import encode_header

#: Extra bytes fetched to merge nearby ranges into fewer requests, as a share of the bytes needed.
GAP_BUDGET = 0.05


def layer_placements(manifest: Manifest, ep_size: int, num_redundant: int = 0, placement_file: Path | None = None,
                     engine: str = "vllm") -> dict[MoELayer, Placement]:
    """Each layer's placement at ``ep_size`` under the engine's rule (as ``inspect``/``plan`` show it)."""
    n = manifest.dims.n_routed_experts
    placement = (Placement.from_file(placement_file, n, ep_size) if placement_file is not None
                 else Placement.default(n, ep_size, num_redundant))
    like_decoder = families.by_name(manifest.family).sglang_mtp_like_decoder
    return {layer: layer_placement(engine, placement, layer.is_mtp, manifest.dims.experts_of(layer), like_decoder)
            for layer in manifest.layers}


def header_bytes(manifest: Manifest, layer: MoELayer) -> bytes:
    """A store file's header, as the writer writes it for the manifest's dims."""
    return encode_header(rank_shard_specs(layer, manifest.dims.experts_of(layer), manifest.dims),
                         store_metadata(layer, manifest.dims))


def needed_ranges(manifest: Manifest, placements: dict[MoELayer, Placement], ranks: Sequence[int],
                  ) -> dict[str, list[tuple[int, int]]]:
    """Per store file: the ``(offset, nbytes)`` ranges ``ranks`` read, their union, plus the header."""
    needed = {}
    for layer, placement in placements.items():
        reads = [read for rank in ranks
                 for read in store.rank_read_plan(manifest, layer, placement.rank_logical_ids(rank))]
        head = store.Read("header", 0, 0, len(header_bytes(manifest, layer)))
        needed[manifest.expert_file(layer)] = store.merged_ranges([head, *reads])
    return needed


def coalesce(ranges: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    """Merge the smallest gaps between sorted ranges while their total stays within ``budget`` bytes."""
    gaps = sorted((ranges[i + 1][0] - (ranges[i][0] + ranges[i][1]), i) for i in range(len(ranges) - 1))
    merge, spent = set(), 0
    for gap, i in gaps:
        if spent + gap > budget:
            break
        spent += gap
        merge.add(i)
    out: list[list[int]] = []
    for i, (start, n) in enumerate(ranges):
        if out and i - 1 in merge:
            out[-1][1] = start + n
        else:
            out.append([start, start + n])
    return [(start, end - start) for start, end in out]


def _fetch(fs: Any, url: str, start: int, n: int, where: str) -> bytes:
    try:
        data = fs.cat_file(url, start=start, end=start + n)
    except _hub_errors() as e:
        raise HubError(f"{where}: {e}") from None
    if len(data) != n:
        raise HubError(f"{where}: asked for {n} bytes at {start}, got {len(data)}")
    return data


def pull_ranges(repo_id: str, local_dir: Path | str, ep_size: int, ranks: str | None = None, *,
                num_redundant: int = 0, placement_file: Path | None = None, engine: str = "vllm",
                revision: str | None = None, non_expert: bool = True, verify: bool = True,
                max_workers: int = 8) -> dict[str, Any]:
    """Pull the manifest, small files (and non-expert shards) of a store on the hub, then just the
    ranges of its expert files that ranks ``ranks`` of ``ep_size`` read, into ``local_dir``."""
    local_dir = Path(local_dir)
    base = pull(repo_id, None, local_dir, revision, non_expert=non_expert, verify=verify, experts=False,
                max_workers=max_workers)
    manifest = read_manifest(base.path)
    where = f"{repo_id}@{base.commit[:12]}"
    if not manifest.store:
        raise HubError(f"{where}: a per-rank conversion (ep_size={manifest.ep_size}); pull its ranks with --ranks "
                       "alone (--ep-size is for a store)")
    try:
        placements = layer_placements(manifest, ep_size, num_redundant, placement_file, engine)
        chosen = parse_ranks(ranks, ep_size)
    except PlacementError as e:
        raise HubError(f"{where}: {e}") from None
    needed = needed_ranges(manifest, placements, chosen)
    need = sum(n for ranges in needed.values() for _, n in ranges)
    total_budget = int(need * GAP_BUDGET)
    fetch = {rel: coalesce(ranges, total_budget * sum(n for _, n in ranges) // max(1, need))
             for rel, ranges in needed.items()}
    repo = repo_id.partition("@")[0]
    fs = huggingface_hub.HfFileSystem()
    record = _read_record(local_dir, base.commit)
    fetched = 0
    _write_record(local_dir, record)  # first: a load never reads a range this pull has not recorded
    with ThreadPoolExecutor(max_workers) as pool:
        for layer in placements:
            rel = manifest.expert_file(layer)
            size = manifest.file(rel).size
            url = f"{repo}@{base.commit}/{rel}"
            jobs = [(start, n, pool.submit(_fetch, fs, url, start, n, f"{where}/{rel}")) for start, n in fetch[rel]]
            dst = local_dir / rel
            have = record["files"].get(rel) if dst.is_file() else None
            tmp = dst if have else partial_path(dst)  # ranges added to an earlier pull's file in place
            dst.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | (0 if have else os.O_TRUNC), 0o644)
            try:
                os.ftruncate(fd, size)
                for start, n, job in jobs:
                    data = job.result()
                    if start == 0 and data[:len(head := header_bytes(manifest, layer))] != head:
                        raise HubError(f"{where}/{rel}: header differs from the one manifest.json's dims give "
                                       "(a corrupted or foreign file)")
                    os.pwrite(fd, data, start)
                    fetched += n
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, dst)
            record["files"][rel] = [list(r) for r in store.merged_ranges(
                [store.Read("", s, 0, n) for s, n in [*map(tuple, have or []), *fetch[rel]]])]
    _write_record(local_dir, record)
    return {"path": str(local_dir), "repo_id": repo, "commit": base.commit, "ep_size": ep_size, "ranks": chosen,
            "needed_bytes": need, "fetched_bytes": fetched, "requests": sum(len(r) for r in fetch.values()),
            "store_expert_bytes": sum(manifest.file(manifest.expert_file(l)).size for l in placements),
            "other_files": len(base.files)}


def _read_record(local_dir: Path, commit: str) -> dict[str, Any]:
    path = local_dir / STATE_DIR / store.RANGES_NAME
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"commit": commit, "files": {}}
    return record if isinstance(record, dict) and record.get("commit") == commit else {"commit": commit, "files": {}}


def _write_record(local_dir: Path, record: dict[str, Any]) -> None:
    path = local_dir / STATE_DIR / store.RANGES_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(path)
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
