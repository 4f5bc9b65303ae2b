"""Expert placement: vLLM's default mapping, redundant experts, explicit placements."""

from __future__ import annotations

import json

import pytest

from megamoe_convert.placement import Placement, PlacementError, parse_ranks


def vllm_default_slot(rank: int, slot: int, experts_per_rank: int, n_logical: int) -> int:
    """vLLM: local slot s of rank r is physical p = r*E + s, holding logical p % n_logical."""
    return (rank * experts_per_rank + slot) % n_logical


@pytest.mark.parametrize("n_logical,ep_size,redundant", [(8, 1, 0), (8, 4, 0), (8, 4, 4), (256, 8, 0),
                                                          (256, 16, 32), (384, 64, 0), (6, 4, 2)])
def test_default_matches_vllm(n_logical, ep_size, redundant):
    p = Placement.default(n_logical, ep_size, redundant)
    assert p.n_physical == n_logical + redundant
    assert p.experts_per_rank == (n_logical + redundant) // ep_size
    for rank in range(ep_size):
        assert p.experts_start(rank) == rank * p.experts_per_rank
        assert p.rank_logical_ids(rank) == tuple(vllm_default_slot(rank, s, p.experts_per_rank, n_logical)
                                                 for s in range(p.experts_per_rank))
    assert p.is_default()
    assert Placement.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_redundant_experts_replicate_the_first_logical_experts():
    p = Placement.default(8, 4, 4)
    assert p.physical_to_logical == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3)
    assert p.rank_logical_ids(2) == (6, 7, 0) and p.rank_logical_ids(3) == (1, 2, 3)


@pytest.mark.parametrize("n,ep,r", [(8, 3, 0), (8, 4, 1), (256, 7, 0)])
def test_impossible_combinations_are_refused(n, ep, r):
    with pytest.raises(PlacementError, match=f"not divisible by ep_size={ep}"):
        Placement.default(n, ep, r)


def test_explicit_placement_file(tmp_path):
    path = tmp_path / "eplb.json"
    ids = [3, 0, 1, 2, 3, 0, 2, 1]
    path.write_text(json.dumps({"physical_to_logical": ids}))
    p = Placement.from_file(path, 4, 2)
    assert p.rank_logical_ids(0) == (3, 0, 1, 2) and p.rank_logical_ids(1) == (3, 0, 2, 1)
    assert not p.is_default()
    path.write_text(json.dumps(ids))  # a bare list works too
    assert Placement.from_file(path, 4, 2) == p


@pytest.mark.parametrize("ids,message", [
    ([0, 1, 2, 0], r"logical experts \[3\] have no physical slot"),
    ([0, 1, 2, 7], "out of range"),
    ([0, 1, 2], "do not divide over ep_size=2"),
    ("0,1,2,3", "expected a JSON list"),
])
def test_explicit_placement_is_validated(tmp_path, ids, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(ids))
    with pytest.raises(PlacementError, match=message) as info:
        Placement.from_file(path, 4, 2)
    assert str(path) in str(info.value)


def test_rank_checks_and_rank_lists():
    p = Placement.default(8, 4)
    with pytest.raises(PlacementError, match="rank 4 out of range"):
        p.rank_logical_ids(4)
    assert parse_ranks(None, 4) == [0, 1, 2, 3]
    assert parse_ranks("0,2-3", 4) == [0, 2, 3]
    with pytest.raises(PlacementError, match="outside 0..3"):
        parse_ranks("2-5", 4)
    with pytest.raises(PlacementError, match="cannot parse"):
        parse_ranks("x", 4)
    with pytest.raises(PlacementError, match=r"'3-1' is an empty range \(write it low-high, e.g. 1-3\)"):
        parse_ranks("3-1", 4)
