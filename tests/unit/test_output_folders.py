"""Which folders the tool writes into: a new or empty one, or one it wrote before; never a foreign
folder (a source checkpoint, say), never the source it converts; and a folder it rewrites for
another commit keeps none of the older commit's files under the new manifest. No network."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hub_fake import FakeHub

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import LoadError, MegamoeError
from megamoe_convert.hub.pull import pull
from megamoe_convert.hub.push import push
from megamoe_convert.hub.ranges import pull_ranges
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.synth.write import synthesize


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def fake(tmp_path, monkeypatch) -> FakeHub:
    return FakeHub(tmp_path / "server").install(monkeypatch, tmp_path / "cache")


@pytest.mark.parametrize("how", ["pull", "pull --ep-size", "pull --ep-size with a bad argument"])
def test_a_pull_into_a_folder_that_is_no_megamoe_output_is_refused_before_anything_changes(fake, tiny_ckpt, tmp_path,
                                                                                          how):
    store = tmp_path / "store"
    convert(tiny_ckpt, store, ConvertOptions(ep_size=None, fsync=False))
    push(store, "team/store")
    foreign = tmp_path / "checkpoint"
    shutil.copytree(tiny_ckpt, foreign)
    before = tree(foreign)
    refusal = "not divisible by ep_size=3" if "bad" in how else "not a megamoe output"
    with pytest.raises(MegamoeError, match=refusal):
        if how == "pull":
            pull("team/store", None, foreign)
        else:
            pull_ranges("team/store", foreign, 3 if "bad" in how else 4, "0")
    assert tree(foreign) == before and not (foreign / ".megamoe").exists()


def test_convert_never_writes_into_its_own_source(tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    (src / ".megamoe").mkdir()  # what would make it look like an earlier output
    before = tree(src)
    for out in (src, tmp_path / "link-to-src"):
        if out != src:
            out.symlink_to(src, target_is_directory=True)
        with pytest.raises(MegamoeError, match="is the source checkpoint"):
            convert(src, out, ConvertOptions(ep_size=None, fsync=False))
        assert tree(src) == before


def test_pulling_other_ranks_of_a_new_commit_keeps_none_of_the_older_commits_ranks(fake, tiny_ckpt, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    convert(tiny_ckpt, first, ConvertOptions(ep_size=4, fsync=False))
    synthesize(tmp_path / "other", "tiny", seed=2)
    convert(tmp_path / "other", second, ConvertOptions(ep_size=4, fsync=False))
    push(first, "team/ep4")
    local = tmp_path / "local"
    pull("team/ep4", "0", local)
    push(second, "team/ep4")  # a new commit of the same shapes
    pull("team/ep4", "1", local)
    with pytest.raises(LoadError, match="rank-00000-of-00004"):
        load_rank(local, 0)  # the older commit's rank 0 is not served under the new manifest
    for key, t in load_rank(local, 1)["layers.0.ffn.experts"].tensors.items():
        assert t.equal(load_rank(second, 1)["layers.0.ffn.experts"].tensors[key]), key


def test_a_pull_from_the_cache_that_runs_out_of_disk_names_the_file_and_leaves_no_partial_file(fake, tiny_ckpt,
                                                                                               tmp_path, monkeypatch):
    import errno
    import os

    import huggingface_hub

    from megamoe_convert.hub import pull as hub

    out = tmp_path / "ep2"
    convert(tiny_ckpt, out, ConvertOptions(ep_size=2, fsync=False))
    push(out, "team/ep2")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # files linked in from the cache

    def no_link(src, dst):
        raise OSError(errno.EXDEV, "cross-device link")

    def half_copy(src, dst):
        Path(dst).write_bytes(Path(src).read_bytes()[:10])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(hub.os, "link", no_link)
    monkeypatch.setattr(hub.shutil, "copyfile", half_copy)
    local = tmp_path / "local"
    with pytest.raises(OSError) as raised:
        pull("team/ep2", "0", local)
    assert raised.value.errno == errno.ENOSPC and str(raised.value.filename).startswith(str(local))
    assert not [p for p in local.rglob("*.partial")] and not (local / "manifest.json").exists()
    assert not [name for _, _, names in os.walk(local) for name in names if name.endswith(".partial")]
