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

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import huggingface_hub

from megamoe_convert.hub.pull import HubError, Pinned, _hub_errors, claim_local_dir, pin, pull_into, select_files
from megamoe_convert.layout.placement import Placement, parse_ranks
from megamoe_convert.output import ranged
from megamoe_convert.output.locks import hold_whole_output
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.output.shards import rank_shard_specs, store_metadata
from megamoe_convert.output.writer import OutputFile, file_checksum
from megamoe_convert.serve import store
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import encode_header

#: Extra bytes fetched to merge nearby ranges into fewer requests, as a share of the bytes needed.
GAP_BUDGET = 0.05


def layer_placements(manifest: Manifest, ep_size: int, num_redundant: int = 0, placement_file: Path | None = None,
                     engine: str | None = None) -> dict[MoELayer, Placement]:
    """Each layer's placement at ``ep_size`` under the engine's rule (as ``inspect``/``plan`` show it),
    refused where the store's family and the engine cannot serve it."""
    return store.store_placements(manifest, ep_size, num_redundant, placement_file, engine, "store", HubError)


def header_bytes(manifest: Manifest, layer: MoELayer) -> bytes:
    """A store file's header, as the writer writes it for the manifest's dims."""
    return encode_header(rank_shard_specs(layer, manifest.dims.experts_of(layer), manifest.dims),
                         store_metadata(layer, manifest.dims))


def needed_ranges(manifest: Manifest, placements: dict[MoELayer, Placement], ranks: Sequence[int],
                  ) -> dict[str, list[tuple[int, int]]]:
    """Per store file: the ``(offset, nbytes)`` ranges ``ranks`` read, their union, plus the header.
    The union depends only on which logical experts the ranks hold, read once each."""
    needed = {}
    for layer, placement in placements.items():
        held = sorted({i for rank in ranks for i in placement.rank_logical_ids(rank)})
        head = store.Read("header", 0, 0, len(header_bytes(manifest, layer)))
        needed[manifest.expert_file(layer)] = store.merged_ranges([head, *store.rank_read_plan(manifest, layer, held)])
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
                num_redundant: int = 0, placement_file: Path | None = None, engine: str | None = None,
                revision: str | None = None, non_expert: bool = True, verify: bool = True,
                max_workers: int = 8) -> dict[str, Any]:
    """Pull the manifest, small files (and non-expert shards) of a store on the hub, then just the
    ranges of its expert files that ranks ``ranks`` of ``ep_size`` read, into ``local_dir``.

    One transaction bound to one commit, under the folder's lock (:mod:`megamoe_convert.output.ranged`):
    every argument is checked against the commit's manifest before anything local changes; the record
    is written unfinished first and finished last; ranges an earlier pull of the same commit left are
    kept (fetched again where their file is not as that pull left it)."""
    local_dir = Path(local_dir)
    pinned = pin(repo_id, revision)
    manifest, where = pinned.manifest, f"{pinned.repo_id}@{pinned.commit[:12]}"
    if not manifest.store:
        raise HubError(f"{where}: a per-rank conversion (ep_size={manifest.ep_size}); pull its ranks with --ranks "
                       "alone (--ep-size is for a store)")
    placements = store.store_placements(manifest, ep_size, num_redundant, placement_file, engine, where, HubError)
    chosen = parse_ranks(ranks, ep_size, where)
    needed = needed_ranges(manifest, placements, chosen)
    records, patterns = select_files(manifest, manifest.ranks, non_expert, experts=False)
    with claim_local_dir(local_dir, "`megamoe pull --ep-size`"):
        kept = _kept_ranges(local_dir, pinned)
        ranged.write_record(local_dir, ranged.RangedRecord(pinned.commit, files=kept))  # nothing served meanwhile
        pull_into(pinned, local_dir, records, patterns, non_expert, verify=verify, drop_store=False,
                  max_workers=max_workers)
        files, fetched, requests = _fetch_ranges(pinned, local_dir, list(placements), needed, kept, max_workers)
        ranged.write_record(local_dir, ranged.RangedRecord(pinned.commit, ranged.manifest_checksum(local_dir), True,
                                                           files, pinned.repo_id))  # last: the pull is done
    need = sum(n for ranges in needed.values() for _, n in ranges)
    return {"path": str(local_dir), "repo_id": pinned.repo_id, "commit": pinned.commit, "ep_size": ep_size,
            "ranks": chosen, "needed_bytes": need, "fetched_bytes": fetched, "requests": requests,
            "store_expert_bytes": sum(manifest.file(manifest.expert_file(layer)).size for layer in placements),
            "other_files": len(records)}


def _kept_ranges(local_dir: Path, pinned: Pinned) -> dict[str, ranged.Ranges]:
    """The ranges a finished earlier pull of this very commit and manifest left (else none: a
    damaged record, another commit, an unfinished pull start over)."""
    old = ranged.read_record(local_dir, HubError, damaged_ok=True)
    manifest = file_checksum(pinned.snapshot / MANIFEST_NAME)
    if old is None or not old.complete or old.commit != pinned.commit or old.manifest != manifest \
            or ranged.manifest_checksum(local_dir) != manifest:
        return {}
    return old.files


def _fetch_ranges(pinned: Pinned, local_dir: Path, layers: Sequence[MoELayer],
                  needed: dict[str, list[tuple[int, int]]], kept: dict[str, ranged.Ranges], max_workers: int,
                  ) -> tuple[dict[str, ranged.Ranges], int, int]:
    """Each store file's ranges, fetched at the pinned commit and written at their offsets (a file
    an earlier pull left as it left it gets them in place; any other is written anew, its kept
    ranges fetched again). Returns every file's ranges now held, bytes fetched and requests made."""
    manifest, where = pinned.manifest, f"{pinned.repo_id}@{pinned.commit[:12]}"
    fs = huggingface_hub.HfFileSystem()
    files: dict[str, ranged.Ranges] = {}
    plans = {}
    for layer in layers:
        rel = manifest.expert_file(layer)
        have = kept.get(rel, [])
        in_place = bool(have) and _is_file_of(local_dir / rel, manifest.file(rel).size)
        plans[layer] = (rel, in_place, needed[rel] if in_place else ranged.merge([*have, *needed[rel]]))
    want = sum(n for _, _, ranges in plans.values() for _, n in ranges)
    fetched = requests = 0
    with ThreadPoolExecutor(max_workers) as pool:
        for layer, (rel, in_place, ranges) in plans.items():
            fetch = coalesce(ranges, int(want * GAP_BUDGET) * sum(n for _, n in ranges) // max(1, want))
            url = f"{pinned.repo_id}@{pinned.commit}/{rel}"
            jobs = [(start, n, pool.submit(_fetch, fs, url, start, n, f"{where}/{rel}")) for start, n in fetch]
            head = header_bytes(manifest, layer)
            with OutputFile(local_dir / rel, local_dir, size=manifest.file(rel).size, in_place=in_place) as out:
                for start, n, job in jobs:
                    data = job.result()
                    if start == 0 and data[:len(head)] != head:
                        raise HubError(f"{where}/{rel}: header differs from the one manifest.json's dims give "
                                       "(a corrupted or foreign file)")
                    out.write_at(data, start)
                    fetched += n
                out.finish()
            requests += len(fetch)
            files[rel] = ranged.merge([*(kept.get(rel, []) if in_place else []), *fetch])
    return files, fetched, requests


def fetch_experts(local_dir: Path | str, wanted: Mapping[MoELayer, Sequence[int]], *, timeout: float = 600,
                  max_workers: int = 8) -> int:
    """The byte ranges of logical experts ``wanted[layer]`` that a finished ranged pull into ``local_dir``
    lacks, fetched from the repo and commit it was pulled from and written in place (elastic EP's
    recovery of experts no rank of the node pulled). Under the folder's lock (waiting up to
    ``timeout`` seconds for a rank fetching beside it); the record goes on serving what it served
    while they come (their bytes were holes no reader takes) and names the new ranges last.
    Returns the bytes fetched (0: every range was there)."""
    local_dir = Path(local_dir)
    with hold_whole_output(local_dir, timeout=timeout, who="a fetch of experts' ranges"):
        record = ranged.read_record(local_dir, HubError)
        served = ranged.served_ranges(local_dir, HubError)  # finished, of the folder's own manifest
        if record is None or served is None:
            raise HubError(f"{local_dir}: not a ranged pull (`megamoe pull --ep-size`): no ranges to fetch into it")
        if not record.repo_id:
            raise HubError(f"{ranged.record_path(local_dir)}: records no repo to fetch more ranges from (a pull of an "
                           "older megamoe-convert): rerun `megamoe pull --ep-size` to record it")
        pinned = pin(record.repo_id, record.commit)
        if file_checksum(pinned.snapshot / MANIFEST_NAME) != record.manifest:
            raise HubError(f"{local_dir}: its manifest.json is not the one of {pinned.repo_id}@{record.commit[:12]}")
        manifest, needed, layers = pinned.manifest, {}, []
        for layer, ids in wanted.items():
            rel = manifest.expert_file(layer)
            have = served.get(rel, [])
            missing = [(start, n) for start, n in store.merged_ranges(store.rank_read_plan(manifest, layer, ids))
                       if not ranged.covered(have, start, n)]
            if missing:
                needed[rel] = missing
                layers.append(layer)
        if not needed:
            return 0
        files, fetched, _ = _fetch_ranges(pinned, local_dir, layers, needed, served, max_workers)
        ranged.write_record(local_dir, ranged.RangedRecord(record.commit, record.manifest, True, {**served, **files},
                                                           record.repo_id))  # last: the new ranges served
    return fetched


def _is_file_of(path: Path, size: int) -> bool:
    """A regular file (not a link) of ``size`` bytes: as an earlier pull left it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size
