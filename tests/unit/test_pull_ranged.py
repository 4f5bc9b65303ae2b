"""``pull --ep-size``: a ranged pull of a store is one transaction bound to one commit. Its record
(``.megamoe/ranges.json``) names the commit, the manifest and every range, is written last and
checked by every reader; the pull writes under the folder's lock, never through a link, and leaves
no temporary file; holes of its sparse files are never read as experts. No network (a fake hub)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from hub_fake import FakeHub

from megamoe_convert import faults
from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import LinkInOutput, LoadError, MegamoeError
from megamoe_convert.hub.pull import HubError, pull
from megamoe_convert.hub.push import push
from megamoe_convert.hub.ranges import fetch_experts, pull_ranges
from megamoe_convert.layout.placement import Placement
from megamoe_convert.serve import store
from megamoe_convert.serve.loader import load_rank, open_converted
from megamoe_convert.synth.write import synthesize
from megamoe_convert.verify import verify

REPO_ID = "megamoe-test/ranged"
RECORD = Path(".megamoe/ranges.json")
LAYERS = ("layers.0", "layers.1", "mtp.0")


@pytest.fixture(scope="module")
def local_store(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("store") / "store"
    convert(tiny_ckpt, out, ConvertOptions(ep_size=None, fsync=False))
    return out


@pytest.fixture(scope="module")
def other_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of another checkpoint of the same shapes: a later commit of the same repo."""
    root = tmp_path_factory.mktemp("other")
    synthesize(root / "ckpt", "tiny", seed=2)
    convert(root / "ckpt", root / "store", ConvertOptions(ep_size=None, fsync=False))
    return root / "store"


@pytest.fixture()
def hub(tmp_path, monkeypatch, local_store) -> FakeHub:
    fake = FakeHub(tmp_path / "server").install(monkeypatch, tmp_path / "cache")
    push(local_store, REPO_ID)
    return fake


def rank_slots(converted, rank: int, ep_size: int = 4):
    placement = Placement.default(8, ep_size)
    return {layer: placement.rank_logical_ids(rank) for layer in converted.manifest.layers}


def loaded(out: Path, rank: int, ep_size: int = 4) -> dict[str, dict[str, torch.Tensor]]:
    converted = open_converted(out)
    return {p: dict(layer.tensors) for p, layer in store.load_slots(converted, rank_slots(converted, rank,
                                                                                          ep_size)).items()}


def assert_same(a, b) -> None:
    assert a.keys() == b.keys()
    for prefix in a:
        for key, t in a[prefix].items():
            assert torch.equal(t, b[prefix][key]), (prefix, key)


# ----------------------------------------------------------------------------- links and partial files

@pytest.mark.parametrize("link", ["experts folder", "store file", "partial name"])
def test_a_ranged_pull_never_writes_through_a_link(hub, tmp_path, link):
    node, victim = tmp_path / "node", tmp_path / "victim"
    victim.mkdir()
    target = victim / "layers.0.safetensors"
    target.write_bytes(b"not the tool's" * 1000)
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)  # links put where an earlier pull wrote
    if link == "store file":
        (node / "experts/layers.0.safetensors").unlink()
        (node / "experts/layers.0.safetensors").symlink_to(target)
    elif link == "experts folder":
        shutil.rmtree(node / "experts")
        (node / "experts").symlink_to(victim, target_is_directory=True)
    else:
        (node / "experts/layers.0.safetensors").unlink()
        (node / "experts/.layers.0.safetensors.partial").symlink_to(target)
    with pytest.raises(LinkInOutput, match="symbolic link"):
        pull_ranges(REPO_ID, node, 4, "1", non_expert=False)
    assert sorted(p.name for p in victim.iterdir()) == ["layers.0.safetensors"]
    assert target.read_bytes() == b"not the tool's" * 1000


def test_disk_full_during_a_ranged_pull_names_the_file_and_leaves_no_partial_file(hub, tmp_path, monkeypatch,
                                                                                   local_store):
    node = tmp_path / "node"
    faults.reset()
    monkeypatch.setenv("MEGAMOE_TEST_FAULTS", "enospc-after-bytes=6000")
    with pytest.raises(OSError) as raised:
        pull_ranges(REPO_ID, node, 4, "0", non_expert=False)
    assert raised.value.errno == errno.ENOSPC
    assert str(raised.value.filename).startswith(str(node / "experts")), raised.value.filename
    assert not [p for p in node.rglob("*.partial")]
    monkeypatch.delenv("MEGAMOE_TEST_FAULTS")
    with pytest.raises(LoadError):  # what the failed pull left is not served
        loaded(node, 0)
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)  # the rerun completes it
    assert_same(loaded(node, 0), loaded(local_store, 0))


# ----------------------------------------------------------------------------- holes are never data

def test_load_rank_of_a_ranged_pull_refuses_the_ranges_it_does_not_hold(hub, tmp_path, local_store):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)
    with pytest.raises(LoadError, match="were not pulled"):
        load_rank(node, 0)  # a store's EP 1 view: every expert, most of them holes here
    assert_same(loaded(node, 0), loaded(local_store, 0))


def test_fetch_experts_adds_just_their_missing_ranges_from_the_repo_the_pull_came_from(hub, tmp_path, local_store):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)  # experts 0-1 of every layer
    converted = open_converted(node)
    wanted = {layer: [1, 6] for layer in converted.manifest.layers}
    with pytest.raises(LoadError, match="were not pulled"):
        store.load_slots(converted, wanted)
    before = len(hub.ranged)
    assert fetch_experts(node, wanted) > 0
    assert {path for path, _, _ in hub.ranged[before:]} == {f"experts/{key}.safetensors" for key in LAYERS}
    fetched = len(hub.ranged)
    assert fetch_experts(node, wanted) == 0 and len(hub.ranged) == fetched  # every range there now
    got, want = store.load_slots(converted, wanted), store.load_slots(open_converted(local_store), wanted)
    assert_same({p: dict(x.tensors) for p, x in got.items()}, {p: dict(x.tensors) for p, x in want.items()})


def test_fetch_experts_refuses_a_record_that_names_no_repo(hub, tmp_path):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)
    data = json.loads((node / RECORD).read_text())
    assert data.pop("repo_id") == REPO_ID
    (node / RECORD).write_text(json.dumps(data))
    with pytest.raises(HubError, match="records no repo to fetch more ranges from"):
        fetch_experts(node, {open_converted(node).manifest.layers[0]: [6]})


def test_push_refuses_a_ranged_pull(hub, tmp_path):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0")
    commits = len(hub.commits)
    with pytest.raises(HubError, match="ranged pull"):
        push(node, "megamoe-test/republished")
    assert len(hub.commits) == commits


def test_adding_ranks_to_a_cut_short_file_fetches_its_ranges_again(hub, tmp_path, local_store):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)
    cut = node / "experts/layers.1.safetensors"
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 3)
    pull_ranges(REPO_ID, node, 4, "1", non_expert=False)
    for rank in (0, 1):
        assert_same(loaded(node, rank), loaded(local_store, rank))


# ----------------------------------------------------------------------------- one commit

def test_a_refused_ranged_pull_of_a_new_commit_leaves_the_folder_as_it_was(hub, tmp_path, local_store,
                                                                           other_store):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0")
    before = {p.relative_to(node).as_posix(): p.read_bytes() for p in node.rglob("*") if p.is_file()
              and ".megamoe" not in p.parts and ".cache" not in p.parts}
    push(other_store, REPO_ID)  # a new commit
    with pytest.raises(MegamoeError, match="not divisible by ep_size=3"):
        pull_ranges(REPO_ID, node, 3, "0")
    after = {p.relative_to(node).as_posix(): p.read_bytes() for p in node.rglob("*") if p.is_file()
             and ".megamoe" not in p.parts and ".cache" not in p.parts}
    assert after == before
    assert_same(loaded(node, 0), loaded(local_store, 0))


def test_a_ranged_pull_of_a_new_commit_that_fails_midway_serves_nothing(hub, tmp_path, other_store, monkeypatch):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0")
    push(other_store, REPO_ID)
    real = hub.cat_file

    def failing(url: str, start: int, end: int) -> bytes:
        if "layers.1" in url:
            raise FileNotFoundError("404: the connection dropped")
        return real(url, start, end)
    monkeypatch.setattr(hub, "cat_file", failing)
    with pytest.raises(MegamoeError):
        pull_ranges(REPO_ID, node, 4, "0")
    with pytest.raises(LoadError, match="did not finish"):
        loaded(node, 0)  # neither the old commit's experts under the new manifest, nor half of each
    monkeypatch.setattr(hub, "cat_file", real)
    pull_ranges(REPO_ID, node, 4, "0")
    assert_same(loaded(node, 0), loaded(other_store, 0))


def test_a_whole_pull_or_a_convert_into_a_ranged_pull_replaces_its_record(hub, tmp_path, tiny_ckpt, local_store):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0")
    pull(REPO_ID, None, node)  # the whole store now: every rank served, verify and loader agree
    assert not (node / RECORD).exists()
    assert verify(node).ok
    assert_same(loaded(node, 3), loaded(local_store, 3))
    converted = tmp_path / "converted"
    pull_ranges(REPO_ID, converted, 4, "0")
    convert(tiny_ckpt, converted, ConvertOptions(ep_size=None, fsync=False))
    assert not (converted / RECORD).exists()
    assert verify(converted).ok
    assert_same(loaded(converted, 3), loaded(local_store, 3))


def test_verify_of_a_ranged_pull_says_it_holds_only_ranges(hub, tmp_path):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0")
    report = verify(node)
    assert not report.ok and any("ranged pull" in str(p) for p in report.problems), report.problems


# ----------------------------------------------------------------------------- the record

@pytest.mark.parametrize("record", [
    b"\xff\xfe not json", b"[1, 2]", b'{"files": 5}', b'{"files": {"experts/layers.0.safetensors": [[0]]}}',
    b'{"files": {"experts/layers.0.safetensors": 7}}', b'{"files": {"experts/layers.0.safetensors": [[-5, 9]]}}'])
def test_a_damaged_record_is_one_line_for_loads_and_redone_by_the_pull(hub, tmp_path, local_store, record):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)
    data = json.loads((node / RECORD).read_text())
    (node / RECORD).write_bytes(record.replace(b'{"files"', b'{"commit": "%s", "files"' % data["commit"].encode()))
    with pytest.raises(LoadError, match="ranges.json"):
        loaded(node, 0)
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)
    assert_same(loaded(node, 0), loaded(local_store, 0))


def test_a_record_that_is_a_fifo_is_refused_not_waited_on(hub, tmp_path):
    node = tmp_path / "node"
    pull_ranges(REPO_ID, node, 4, "0", non_expert=False)
    (node / RECORD).unlink()
    os.mkfifo(node / RECORD)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            pull_ranges(REPO_ID, node, 4, "1", non_expert=False)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # release the reader blocked on the FIFO before failing
        os.close(os.open(node / RECORD, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail("pull --ep-size waited on a FIFO named ranges.json")
    assert isinstance(outcome[0], MegamoeError) and "FIFO" in str(outcome[0]), outcome
    with pytest.raises(LoadError, match="FIFO"):
        loaded(node, 0)


# ----------------------------------------------------------------------------- the folder's lock

def test_two_ranged_pulls_into_one_folder_never_both_succeed(hub, tmp_path, monkeypatch, local_store):
    node = tmp_path / "node"
    real, inside, release = hub.cat_file, threading.Event(), threading.Event()

    def slow(url: str, start: int, end: int) -> bytes:
        inside.set()
        release.wait(60)
        return real(url, start, end)
    monkeypatch.setattr(hub, "cat_file", slow)
    first: list[object] = []
    thread = threading.Thread(target=lambda: first.append(pull_ranges(REPO_ID, node, 4, "0", non_expert=False)))
    thread.start()
    try:
        assert inside.wait(60)
        monkeypatch.setattr(hub, "cat_file", real)
        with pytest.raises(MegamoeError, match="is writing this directory"):
            pull_ranges(REPO_ID, node, 4, "1", non_expert=False)
    finally:
        release.set()
        thread.join(60)
    assert first and first[0]["ranks"] == [0]
    ranges = json.loads((node / RECORD).read_text())["files"]
    assert set(ranges) == {f"experts/{k}.safetensors" for k in LAYERS}
    assert_same(loaded(node, 0), loaded(local_store, 0))


# ----------------------------------------------------------------------------- what the engine can serve

def test_a_ranged_pull_refuses_what_the_family_and_engine_cannot_serve(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path / "server").install(monkeypatch, tmp_path / "cache")
    synthesize(tmp_path / "kimi", "kimi-k3-tiny", seed=1)
    convert(tmp_path / "kimi", tmp_path / "kimi-store", ConvertOptions(ep_size=None, fsync=False))
    push(tmp_path / "kimi-store", "megamoe-test/kimi")
    for kwargs, words in (({"engine": "sglang"}, "not sglang"), ({"num_redundant": 4}, "redundant")):
        with pytest.raises(MegamoeError, match=words):
            pull_ranges("megamoe-test/kimi", tmp_path / "node", 4, "0", **kwargs)
        assert not (tmp_path / "node").exists()
    assert fake.ranged == []
