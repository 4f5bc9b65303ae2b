"""Expert placement: vLLM's default mapping, redundant experts, explicit placements."""

from __future__ import annotations

import json

import pytest

from megamoe_convert.layout.placement import Placement, PlacementError, layer_placement, parse_ranks


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


def test_sglang_builds_the_mtp_layer_without_redundant_experts():
    """SGLang's DeepSeek-V4 NextN layer has no expert location: 8 experts over 4 ranks are 2 per
    rank, rank r holding [2r, 2r+1]; decoder layers keep the redundant placement (as in vLLM)."""
    decoder = Placement.default(8, 4, 4)
    mtp = layer_placement("sglang", decoder, is_mtp=True)
    assert mtp.experts_per_rank == 2 and [mtp.rank_logical_ids(r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layer_placement("sglang", decoder, is_mtp=False) is decoder
    assert layer_placement("vllm", decoder, is_mtp=True) is decoder
    with pytest.raises(PlacementError, match="SGLang builds the MTP layer with 6 experts"):
        layer_placement("sglang", Placement.default(6, 4, 2), is_mtp=True)
    with pytest.raises(PlacementError, match="unknown engine 'trt'"):
        layer_placement("trt", decoder, is_mtp=False)


def test_convert_for_sglang_records_the_engine_and_writes_the_mtp_layer_its_own_way(tiny_ckpt, tmp_path):
    from conftest import run_cli

    from megamoe_convert.output.manifest import read_manifest
    from megamoe_convert.serve.loader import load_rank

    out = tmp_path / "sglang"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 4, "--num-redundant-experts", 4, "--engine", "sglang",
            "--experts-only")
    manifest = read_manifest(out)
    assert manifest.engine == "sglang" and json.loads((out / "manifest.json").read_text())["engine"] == "sglang"
    layers = load_rank(out, 3)
    assert layers["mtp.0.ffn.experts"].logical_ids == (6, 7) and layers["mtp.0.ffn.experts"].experts_start_idx == 6
    assert layers["layers.1.ffn.experts"].logical_ids == (1, 2, 3)
    assert "OK" in run_cli("verify", out, "--source", tiny_ckpt).stdout


def test_inspect_and_plan_say_which_engines_serve_the_shapes(tiny_ckpt):
    from conftest import run_cli

    info = json.loads(run_cli("inspect", tiny_ckpt, "--ep-size", 4, "--json").stdout)
    assert info["engines"] == {"vllm": {"supported": True, "reason": ""},
                               "sglang": {"supported": False, "reason": "hidden_size=256 is not a multiple of 512"}}
    # vLLM 0.30 pads I = 128 to 512 in finalize_weights: 0.31-0.33 serve the tiny preset's shapes
    assert "vLLM 0.31-0.33 on Blackwell; not SGLang (hidden_size=256 is not a multiple of 512)" in run_cli(
        "inspect", tiny_ckpt).stdout
    plan = json.loads(run_cli("plan", tiny_ckpt, "--ep-size", 4, "--num-redundant-experts", 4, "--engine", "sglang",
                              "--json").stdout)
    assert plan["engine"] == "sglang" and plan["engines"]["vllm"] == {"supported": True, "reason": ""}
    assert plan["layer_placements"]["mtp.0"]["physical_to_logical"] == list(range(8))
    text = run_cli("plan", tiny_ckpt, "--ep-size", 4, "--num-redundant-experts", 4, "--engine", "sglang").stdout
    assert "mtp.0 (sglang)" in text and "served by: vLLM 0.31-0.33 on Blackwell; not SGLang" in text


def test_a_layer_with_its_own_expert_count_gets_vllms_default_placement_of_it():
    """DeepSeek-V4.1's DSpark MTP layers: vLLM's default placement of their own count, with the
    decoder layers' redundant experts (``DeepseekV4MoE._init_mega_moe_experts``)."""
    decoder = Placement.default(384, 64, 64)
    dspark = layer_placement("vllm", decoder, True, 128)
    assert (dspark.n_logical, dspark.num_redundant, dspark.experts_per_rank) == (128, 64, 3)
    assert dspark.rank_logical_ids(42) == (126, 127, 0) and dspark.rank_logical_ids(63) == (61, 62, 63)
    assert layer_placement("vllm", decoder, True, 384) is decoder
    with pytest.raises(PlacementError, match=r"128 experts of their own with 32 redundant ones: 160 physical "
                                             r"experts are not divisible by ep_size=52"):
        layer_placement("vllm", Placement.default(384, 52, 32), True, 128)
    with pytest.raises(PlacementError, match=r"an explicit placement lists the decoder layers' 384 experts"):
        layer_placement("vllm", Placement.from_list([*range(383, -1, -1)], 384, 64), True, 128)
