"""Single experts of a per-rank conversion (``serve.rank_slots``): each read by byte ranges from a
rank file holding it, byte-exact with that rank's own load; an expert in no rank file present is
refused naming the expert, the layer and the files that would hold it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from megamoe_convert.errors import LoadError
from megamoe_convert.serve import rank_slots, store
from megamoe_convert.serve.loader import load_rank, open_converted


def by_logical(out: Path) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """Every logical expert's per-slot tensors, from each rank's own load (the first rank holding it)."""
    converted = open_converted(out)
    found: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for rank in converted.manifest.ranks:
        for prefix, layer in load_rank(converted, rank).items():
            for slot, logical in enumerate(layer.logical_ids):
                found.setdefault(prefix, {}).setdefault(logical, {k: t[slot] for k, t in layer.tensors.items()})
    return found


def test_each_expert_is_read_from_a_rank_file_holding_it_as_that_ranks_load(tiny_converted, monkeypatch):
    converted = open_converted(tiny_converted)
    want = by_logical(tiny_converted)
    asked = {layer: [7, 0, 6, 7] for layer in converted.manifest.layers}
    reads = []
    real_fill = store.fill
    monkeypatch.setattr(store, "fill", lambda paths, r, *rest: (reads.append((paths, r)), real_fill(paths, r, *rest)))
    got = rank_slots.load_held_experts(converted, asked)
    for layer, ids in asked.items():
        tensors = got[layer.prefix].tensors
        assert got[layer.prefix].logical_ids == tuple(ids)
        for key, tensor in tensors.items():
            for slot, logical in enumerate(ids):
                assert torch.equal(tensor[slot], want[layer.prefix][logical][key]), (layer.key, key, slot)
    per_slot = sum(t[0].nbytes for layer in got.values() for t in layer.tensors.values())
    assert sum(r.nbytes for _, call in reads for layer_reads in call.values() for r in layer_reads) == 4 * per_slot


def test_an_expert_whose_rank_files_are_gone_is_refused_naming_the_expert_layer_and_files(tiny_converted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_converted, copy, copy_function=os.link)
    converted = open_converted(copy)
    layer = converted.manifest.layers[0]
    holding = [rank for rank in converted.manifest.ranks
               if 5 in converted.manifest.placement_for(layer).rank_logical_ids(rank)]
    for rank in holding:
        (copy / converted.manifest.expert_file(layer, rank)).unlink()
    with pytest.raises(LoadError) as e:
        rank_slots.load_held_experts(converted, {layer: [0, 5]})
    files = "; ".join(f"{converted.manifest.expert_file(layer, r)} (missing (listed in manifest.json))"
                      for r in holding)
    assert str(e.value) == f"{copy}: expert 5 of {layer.key} is in no rank file present: {files}"


def test_a_store_is_not_read_as_rank_files(tiny_ckpt, tmp_path):
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert

    convert(tiny_ckpt, tmp_path / "store", ConvertOptions(ep_size=None, fsync=False))
    converted = open_converted(tmp_path / "store")
    with pytest.raises(LoadError, match="is a store"):
        rank_slots.holders(converted, {converted.manifest.layers[0]: [0]})
