"""Hub push/pull, sources by repo id, ``load_rank`` by repo id. No network.

Two stand-ins for the hub: :class:`hub_fake.FakeHub` (a file-based fake of the few calls
megamoe makes, downloading into the real HF cache layout), and the real ``huggingface_hub``
in offline mode over a pre-populated cache (in process, and through real CLI runs with
``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from hub_fake import FakeHub, cache_put
from typer.testing import CliRunner

from megamoe_convert import load_rank
from megamoe_convert.cli import app
from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import LoadError, ManifestError, MegamoeError
from megamoe_convert.hub.pull import HubError, parse_repo_ref, pull, resolve_source
from megamoe_convert.hub.push import push

REPO_ID = "team/tiny-ep4"
SMALL = {"config.json", "tokenizer_config.json"}
NON_EXPERT = {"model-00001-of-00001.safetensors", "model.safetensors.index.json"}


def rank_files(rank: int) -> set[str]:
    return {f"rank-0000{rank}-of-00004/{layer}.safetensors" for layer in ("layers.0", "layers.1", "mtp.0")}


def converted_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(out).parts)}


def assert_same_rank(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for prefix in a:
        assert a[prefix].logical_ids == b[prefix].logical_ids
        for x, y in zip((*a[prefix].l1, *a[prefix].l2), (*b[prefix].l1, *b[prefix].l2), strict=True):
            assert torch.equal(x, y) and x.stride() == y.stride()


@pytest.fixture()
def fake(tmp_path, monkeypatch) -> FakeHub:
    return FakeHub(tmp_path / "server").install(monkeypatch, tmp_path / "cache")


@pytest.fixture()
def pushed(fake, tiny_converted) -> FakeHub:
    push(tiny_converted, REPO_ID, revision="ep4", private=True)
    fake.downloaded.clear()
    return fake


# ----------------------------------------------------------------------------- push

def test_push_uploads_the_manifests_files_then_manifest_and_card_last(pushed, tiny_ckpt, tiny_converted):
    fake = pushed
    *data_commits, last = [c for c in fake.commits if c[0] == REPO_ID]
    assert last[2] == ["README.md", "manifest.json"]  # one commit, after every data file
    uploaded = {p for c in data_commits for p in c[2]}
    assert uploaded == set(converted_files(tiny_converted)) - {"manifest.json"}  # no .megamoe/, no manifest
    on_hub = {rel: p.read_bytes() for rel, p in fake.files(REPO_ID, "ep4").items()}
    assert {k: v for k, v in on_hub.items() if k not in ("README.md", ".gitattributes")} == \
        converted_files(tiny_converted)
    assert set(fake.files(REPO_ID, "main")) == {".gitattributes"}  # --revision: a branch, main untouched
    assert fake.repos[REPO_ID]["private"]
    card = on_hub["README.md"].decode()
    assert card.startswith("---\n") and "- megamoe" in card
    for fact in ("| ep_size | 4 (ranks: all) |", "| layout version | 1 ", "| MoE layers | 2 decoder + 1 MTP |",
                 "8 logical + 4 redundant = 12 slots, 3 per rank", "| 2 | 6..8 | 6, 7, 0 |",
                 f"`{tiny_ckpt.resolve()}`", f"megamoe pull {REPO_ID} --revision ep4 --ranks 0-3 ",
                 f'load_rank("{REPO_ID}@ep4", rank=0,'):  # usage lines that work as written
        assert fact in card, fact


def test_push_refuses_unfinished_or_damaged_conversions(fake, tiny_ckpt, tiny_converted, tmp_path):
    part = tmp_path / "part"
    convert(tiny_ckpt, part, ConvertOptions(ep_size=4, num_redundant_experts=4, shard=(0, 2), fsync=False))
    with pytest.raises(ManifestError, match="megamoe merge"):
        push(part, REPO_ID)
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_converted, damaged)
    victim = damaged / "rank-00003-of-00004" / "mtp.0.safetensors"
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(HubError, match="not pushing .*mtp.0.safetensors: size"):
        push(damaged, REPO_ID)
    assert fake.commits == []


def test_push_command_checks_checksums_with_verify_then_uploads(fake, tiny_converted, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_converted, damaged)
    victim = damaged / "rank-00001-of-00004" / "layers.0.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size: only --verify can see it
    victim.write_bytes(bytes(data))
    refused = CliRunner().invoke(app, ["push", str(damaged), REPO_ID, "--verify"])
    assert refused.exit_code == 2 and "not pushing" in refused.output and "layers.0.safetensors" in refused.output
    assert fake.commits == []
    done = CliRunner().invoke(app, ["push", str(tiny_converted), REPO_ID, "--revision", "cli", "--verify", "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    manifest = json.loads((tiny_converted / "manifest.json").read_text())
    assert result["files"] == len(manifest["files"]) and result["revision"] == "cli"
    on_hub = {rel: p.read_bytes() for rel, p in fake.files(REPO_ID, "cli").items()}
    assert {k: v for k, v in on_hub.items() if k not in ("README.md", ".gitattributes")} == \
        converted_files(tiny_converted)


def test_repushing_another_conversion_removes_the_old_manifest_before_any_file(fake, tiny_ckpt, tiny_converted,
                                                                                tmp_path):
    push(tiny_converted, REPO_ID)
    push(tiny_converted, REPO_ID)  # the same conversion again (a resumed push): manifest kept
    assert not any(c[2] == ["manifest.json"] for c in fake.commits)
    ep2 = tmp_path / "ep2"
    convert(tiny_ckpt, ep2, ConvertOptions(ep_size=2, experts_only=True, fsync=False))
    before = len(fake.commits)
    push(ep2, REPO_ID)
    delete, *data, last = fake.commits[before:]
    assert delete[2] == ["manifest.json"] and data and last[2] == ["README.md", "manifest.json"]
    assert fake.files(REPO_ID)["manifest.json"].read_bytes() == (ep2 / "manifest.json").read_bytes()
    assert pull(REPO_ID, "1", tmp_path / "pulled").ranks == [1]
    assert json.loads((tmp_path / "pulled" / "manifest.json").read_text())["ep_size"] == 2


# ----------------------------------------------------------------------------- pull

def test_pull_downloads_only_the_named_ranks_and_what_they_share(pushed, tiny_converted, tmp_path):
    fake = pushed
    local = tmp_path / "local"
    result = pull(REPO_ID, "1", local_dir=local, revision="ep4")
    assert result.ranks == [1] and result.verified == "checksum" and result.path == local.resolve()
    assert result.commit == fake.resolve(REPO_ID, "ep4")
    assert set(fake.downloaded) - {"manifest.json"} == SMALL | NON_EXPERT | rank_files(1)
    assert converted_files(local) == {k: v for k, v in converted_files(tiny_converted).items()
                                      if k in SMALL | NON_EXPERT | rank_files(1) | {"manifest.json"}}
    assert_same_rank(load_rank(local, 1), load_rank(tiny_converted, 1))
    with pytest.raises(LoadError, match="missing"):
        load_rank(local, 0)
    fake.downloaded.clear()
    experts_only = pull(f"{REPO_ID}@ep4", [2, 3], non_expert=False)  # into the HF cache
    assert set(fake.downloaded) - {"manifest.json"} == SMALL | rank_files(2) | rank_files(3)
    assert experts_only.path.parent.name == "snapshots"


def test_pull_verifies_checksums_and_force_download_repairs(pushed, tiny_converted):
    first = pull(REPO_ID, "0", revision="ep4")
    blob = (first.path / "rank-00000-of-00004" / "layers.1.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(HubError, match="layers.1.safetensors: checksum mismatch .*--force-download"):
        pull(REPO_ID, "0", revision="ep4")
    assert pull(REPO_ID, "0", revision="ep4", verify=False).verified == "size"
    repaired = pull(REPO_ID, "0", revision="ep4", force_download=True)
    assert (repaired.path / "rank-00000-of-00004" / "layers.1.safetensors").read_bytes() == \
        (tiny_converted / "rank-00000-of-00004" / "layers.1.safetensors").read_bytes()


def test_pull_errors_name_the_problem(pushed, tiny_ckpt, tmp_path):
    fake = pushed
    with pytest.raises(MegamoeError, match="'7' is outside 0..3 for ep_size=4"):
        pull(REPO_ID, "7", revision="ep4")
    with pytest.raises(HubError, match="repository not found"):
        pull("team/nothing-here", "0")
    with pytest.raises(HubError, match="revision 'nope' not found"):
        pull(REPO_ID, "0", revision="nope")
    with pytest.raises(HubError, match="no manifest.json"):
        pull(REPO_ID, "0")  # main holds no conversion
    subset = tmp_path / "subset"
    convert(tiny_ckpt, subset, ConvertOptions(ep_size=4, ranks="0,1", experts_only=True, fsync=False))
    push(subset, "team/subset")
    with pytest.raises(HubError, match=r"rank 3 was not converted .*\[0, 1\]"):
        pull("team/subset", "1,3")
    assert "rank-00003" not in " ".join(fake.downloaded)


def test_source_readme_is_kept_in_the_card_and_not_checked_on_pull(fake, tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    (src / "README.md").write_text("---\nlicense: mit\nlibrary_name: transformers\n---\n# Tiny V4\n\nHello.\n")
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(ep_size=2, fsync=False))
    push(out, REPO_ID)
    card = fake.files(REPO_ID)["README.md"].read_text()
    assert "license: mit" in card and "- megamoe" in card
    assert card.index("| ep_size | 2") < card.index("## Original model card") < card.index("Hello.")
    result = pull(REPO_ID, None, tmp_path / "local")
    assert result.not_downloaded == ["README.md"] and result.ranks == [0, 1]
    assert not (tmp_path / "local" / "README.md").exists()


# ----------------------------------------------------------------------------- repo ids elsewhere

def test_load_rank_by_repo_id_pulls_just_that_rank(pushed, tiny_converted):
    fake = pushed
    experts = load_rank(f"{REPO_ID}@ep4", 2)
    assert set(fake.downloaded) - {"manifest.json"} == SMALL | rank_files(2)  # no non-expert shards
    assert_same_rank(experts, load_rank(tiny_converted, 2))
    with pytest.raises(HubError, match="repository not found .*not a local directory either"):
        load_rank("team/missing", 0)


def test_install_by_repo_id_pulls_just_that_rank(pushed, tiny_converted):
    from vllm_stand_in import STAND_INS, experts_of, stand_in_model

    from megamoe_convert.engines.vllm import install

    model = stand_in_model(STAND_INS["kernel_layout"], 2)
    assert install(model, f"{REPO_ID}@ep4", rank=2, probe=False) == 3  # a stand-in has no loading code to probe
    assert {p.split("/")[0] for p in pushed.downloaded if "/" in p} == {"rank-00002-of-00004"}
    want = load_rank(tiny_converted, 2)
    for module, key in zip(experts_of(model), ["layers.0", "layers.1", "mtp.0"], strict=True):
        assert torch.equal(module.w13_weight, want[f"{key}.ffn.experts"].l1[0])


def test_convert_from_a_hub_repo_id(fake, tiny_ckpt, tiny_converted, tmp_path):
    api = huggingface_hub.HfApi()
    api.create_repo("deepseek-fake/tiny-v4")
    api.create_branch("deepseek-fake/tiny-v4", branch="v1")
    api.upload_folder(repo_id="deepseek-fake/tiny-v4", folder_path=tiny_ckpt, revision="v1")
    with pytest.raises(HubError, match="revision 'v2' not found"):
        resolve_source("deepseek-fake/tiny-v4", "v2")
    src = resolve_source("deepseek-fake/tiny-v4@v1")
    assert src.parent.name == "snapshots" and src.is_relative_to(tmp_path / "cache")
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(ep_size=4, num_redundant_experts=4, fsync=False))
    got, want = converted_files(out), converted_files(tiny_converted)
    assert {k: v for k, v in got.items() if k != "manifest.json"} == \
        {k: v for k, v in want.items() if k != "manifest.json"}
    push(out, "team/from-hub")
    assert "base_model: deepseek-fake/tiny-v4" in fake.files("team/from-hub")["README.md"].read_text()


@pytest.mark.parametrize("text,expected", [
    ("owner/name", ("owner/name", None)), ("owner/name@ep8", ("owner/name", "ep8")),
    ("/abs/path", None), ("./rel", None), ("a/b/c", None), ("name", None), ("owner/na..me", None),
])
def test_what_counts_as_a_repo_id(text, expected):
    assert parse_repo_ref(text) == expected


# ----------------------------------------------------------------------------- the real library, offline

@pytest.fixture()
def offline_cache(tmp_path, tiny_ckpt, tiny_converted) -> Path:
    """A real-layout HF cache: the source checkpoint, and a pushed conversion of which only
    the manifest, the small files and rank 2 were ever downloaded."""
    cache = tmp_path / "hf-cache"
    cache_put(cache, "deepseek-fake/tiny-v4", "1" * 40, {p.name: p for p in tiny_ckpt.iterdir()})
    keep = {"manifest.json"} | SMALL | rank_files(2)
    cache_put(cache, REPO_ID, "2" * 40, {rel: tiny_converted / rel for rel in keep})
    return cache


def test_real_library_offline_pull_and_load(offline_cache, tiny_converted, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(offline_cache))
    result = pull(REPO_ID, "2", non_expert=False)
    assert result.commit == "2" * 40
    assert result.path == offline_cache / "models--team--tiny-ep4/snapshots" / result.commit
    assert_same_rank(load_rank(REPO_ID, 2), load_rank(tiny_converted, 2))
    with pytest.raises(HubError, match="rank-00001-of-00004/.*not in the Hugging Face cache, and HF_HUB_OFFLINE"):
        pull(REPO_ID, "1", non_expert=False)  # never downloaded, and the hub is out of reach
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):
        resolve_source("deepseek-fake/not-cached")
    failed = CliRunner().invoke(app, ["pull", REPO_ID, "--ranks", "0-1", "--experts-only"])
    assert failed.exit_code == 2 and "error: " in failed.output and "rank-00000-of-00004" in failed.output


def test_offline_pull_into_a_local_dir_takes_the_files_from_the_cache(offline_cache, tiny_converted, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(offline_cache))
    local = tmp_path / "model"
    result = pull(REPO_ID, "2", local_dir=local, non_expert=False)
    assert result.path == local
    assert converted_files(local) == {rel: (tiny_converted / rel).read_bytes()
                                      for rel in {"manifest.json"} | SMALL | rank_files(2)}
    assert_same_rank(load_rank(local, 2), load_rank(tiny_converted, 2))


def test_inspect_and_plan_take_a_revision_like_convert(offline_cache, tiny_ckpt, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(offline_cache))
    runner = CliRunner()
    for command in (["inspect", "deepseek-fake/tiny-v4", "--json"], ["plan", "deepseek-fake/tiny-v4", "--ep-size", "2",
                                                                     "--json"]):
        found = runner.invoke(app, [*command, "--revision", "1" * 40])
        assert found.exit_code == 0, found.output
        missing = runner.invoke(app, [*command, "--revision", "f" * 40])
        assert missing.exit_code == 2 and "HF_HUB_OFFLINE" in missing.output
    info = json.loads(runner.invoke(app, ["inspect", "deepseek-fake/tiny-v4", "--revision", "1" * 40, "--json"]).stdout)
    assert info["path"].endswith("1" * 40) and info["moe_layers"] == ["layers.0", "layers.1", "mtp.0"]
