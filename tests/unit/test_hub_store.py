"""A store on the (fake) hub: pushed whole, pulled whole, and pulled by ranges (``pull --ep-size``):
just the byte ranges a node's ranks read, within 10% of them. No network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hub_fake import FakeHub
from typer.testing import CliRunner

from megamoe_convert.cli import app
from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import LoadError
from megamoe_convert.hub.pull import HubError, pull
from megamoe_convert.hub.push import push
from megamoe_convert.hub.ranges import pull_ranges
from megamoe_convert.hub.resolve import open_converted
from megamoe_convert.layout.placement import Placement
from megamoe_convert.serve import store

REPO_ID = "megamoe-test/tiny-store"
EP_SIZE, REDUNDANT = 8, 8  # 2 slots a rank: ranks 0-1 hold experts 0-3, ranks 4-5 again


@pytest.fixture(scope="module")
def local_store(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("store") / "store"
    convert(tiny_ckpt, out, ConvertOptions(ep_size=None, fsync=False))
    return out


@pytest.fixture()
def pushed(tmp_path, monkeypatch, local_store) -> FakeHub:
    fake = FakeHub(tmp_path / "server").install(monkeypatch, tmp_path / "cache")
    push(local_store, REPO_ID)
    fake.downloaded.clear()
    return fake


def slots(converted, rank, placement=None):
    placement = placement or Placement.default(8, EP_SIZE, REDUNDANT)
    return {layer: placement.rank_logical_ids(rank) for layer in converted.manifest.layers}


def same(a, b):
    assert a.keys() == b.keys()
    for prefix in a:
        for key, t in a[prefix].tensors.items():
            assert torch.equal(t, b[prefix].tensors[key]), (prefix, key)


def test_a_pushed_store_pulls_whole_without_an_ep_size(pushed, local_store, tmp_path):
    result = pull(REPO_ID, None, tmp_path / "whole")
    assert {r.path for r in result.files} >= {f"experts/{k}.safetensors" for k in ("layers.0", "layers.1", "mtp.0")}
    same(store.load_slots(open_converted(result.path), slots(open_converted(result.path), 5)),
         store.load_slots(open_converted(local_store), slots(open_converted(local_store), 5)))


def test_a_ranged_pull_fetches_just_the_nodes_ranges_within_ten_percent(pushed, local_store, tmp_path):
    node = tmp_path / "node0"
    data = pull_ranges(REPO_ID, node, EP_SIZE, "0-1,4", num_redundant=REDUNDANT, non_expert=False)
    fetched = sum(n for rel, _, n in pushed.ranged)
    assert fetched == data["fetched_bytes"] and all(rel.startswith("experts/") for rel, _, _ in pushed.ranged)
    assert not any(p.startswith("experts/") for p in pushed.downloaded)  # no whole expert file came down
    # what ranks 0, 1, 4 read of the local store, each distinct byte once (their bytes + the headers)
    converted = open_converted(local_store)
    need = 0
    for layer in converted.manifest.layers:
        reads = [r for rank in (0, 1, 4) for r in store.plan_reads(
            store.check_store_file(local_store / f"experts/{layer.key}.safetensors", converted.manifest, layer),
            8, Placement.default(8, EP_SIZE, REDUNDANT).rank_logical_ids(rank),
            [k for k in store.slot_specs(converted.manifest, layer, 2)])]
        need += sum(n for _, n in store.merged_ranges(reads)) + 4096  # + the header
    assert data["needed_bytes"] == need and need <= fetched <= 1.1 * need
    assert fetched < 0.7 * data["store_expert_bytes"]  # experts 0-3: half the store (+ shared experts, headers)
    pulled = open_converted(node)
    for rank in (0, 1, 4, 5):  # rank 5 holds experts 2, 3 again: pulled with rank 1's
        same(store.load_slots(pulled, slots(pulled, rank)), store.load_slots(converted, slots(converted, rank)))
    with pytest.raises(LoadError, match=r"were not pulled .*pull these ranks with `megamoe pull --ep-size`"):
        store.load_slots(pulled, slots(pulled, 1, Placement.default(8, 2)))  # experts 4-7 of EP 2 rank 1...
    # ... until a second pull adds that rank's ranges into the same files
    pull_ranges(REPO_ID, node, 2, "1", non_expert=False)
    same(store.load_slots(pulled, slots(pulled, 1, Placement.default(8, 2))),
         store.load_slots(converted, slots(converted, 1, Placement.default(8, 2))))


def test_pull_ep_size_on_the_command_line_and_its_refusals(pushed, local_store, tmp_path):
    runner = CliRunner()
    done = runner.invoke(app, ["pull", REPO_ID, "--ep-size", "4", "--ranks", "3", "--local-dir", str(tmp_path / "n"),
                               "--experts-only", "--json"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.output[done.output.index("{"):])
    assert data["ranks"] == [3] and data["fetched_bytes"] <= 1.1 * data["needed_bytes"]
    no_dir = runner.invoke(app, ["pull", REPO_ID, "--ep-size", "4", "--ranks", "3"])
    assert no_dir.exit_code != 0 and "give --local-dir" in no_dir.output
    bad = runner.invoke(app, ["pull", REPO_ID, "--ep-size", "3", "--local-dir", str(tmp_path / "m")])
    assert bad.exit_code != 0 and "not divisible by ep_size=3" in bad.output


def test_a_store_file_whose_header_is_not_the_manifests_is_refused(pushed, tmp_path):
    rel = "experts/layers.0.safetensors"
    path = pushed.files(REPO_ID)[rel]
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the header's JSON
    pushed.commit(REPO_ID, None, {rel: bytes(data)}, "tamper")
    with pytest.raises(HubError, match=r"experts/layers.0.safetensors: header differs"):
        pull_ranges(REPO_ID, tmp_path / "node", 4, "0", non_expert=False, verify=False)


def test_a_store_by_repo_id_loads_any_rank_after_pulling_it_whole(pushed, local_store):
    """``load_slots`` / ``install`` on ``owner/name``: the store's slots are the engine's, unknown
    before the model exists, so the whole store is pulled (``pull --ep-size`` for a node's ranges)."""
    converted = open_converted(REPO_ID, [5])
    assert {p for p in pushed.downloaded if p.startswith("experts/")} == {
        f"experts/{k}.safetensors" for k in ("layers.0", "layers.1", "mtp.0")}
    same(store.load_slots(converted, slots(converted, 5)), store.load_slots(open_converted(local_store),
                                                                            slots(converted, 5)))
