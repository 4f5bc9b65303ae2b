"""SGLang's ``--load-format presharded`` dumps every rank's post-processed weights into the folder it
serves: ``OUT/presharded/<signature>/``. That folder is the user's data, whatever it holds: every
command on a real conversion with such a dump beside it leaves it byte for byte, never publishes it,
and never reports it as damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_runs import run_cli
from hub_fake import FakeHub
from safetensors.torch import save_file

from megamoe_convert.output.clearing import remove_owned
from megamoe_convert.output.naming import USER_DIRS
from megamoe_convert.output.writer import FileRecord, file_checksum

REPO_ID = "owner/converted"
#: What SGLang 0.5.23's ``PreshardedModelLoader`` leaves, and what megamoe-convert writes beside it.
DUMP = "presharded/TP-4-sig-0123456789abcdef"


def dump_into(out: Path) -> dict[str, bytes]:
    """A dump as SGLang writes one (its weight files end ``.safetensor``), a second one of a release
    naming them ``.safetensors``, and the conversion record; returns every file's bytes."""
    folder = out / DUMP
    folder.mkdir(parents=True)
    save_file({"0" * 32: torch.arange(64, dtype=torch.int8)}, str(folder / "model-00000-common.safetensor"))
    save_file({"1" * 32: torch.ones(16, dtype=torch.int32)}, str(folder / "model-00001-rank-000.safetensor"))
    other = out / "presharded" / "TP-4-sig-fedcba9876543210"
    other.mkdir()
    save_file({"2" * 32: torch.zeros(8)}, str(other / "model-00000-common.safetensors"))
    (folder / "checksum.json").write_text(json.dumps({"version": 1, "world_size": 4, "files": []}))
    (folder / "READY").write_text(json.dumps({"plan_version": 1, "world_size": 4}))
    (folder / "megamoe-conversion.json").write_text(json.dumps({"conversion": str(out)}))
    return dumped(out)


def dumped(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted((out / "presharded").rglob("*"))
            if p.is_file()}


@pytest.fixture
def out(tiny_converted: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ep4"
    shutil.copytree(tiny_converted, copy)  # its .megamoe state too: a rerun resumes it
    return copy


def test_the_dump_folder_is_the_users():
    assert USER_DIRS == ("presharded",)


def test_nothing_deletes_in_the_dump_even_where_a_record_names_it(out):
    """The one deleting code (``clearing``) passes over the folder whatever a journal or manifest says."""
    files = dump_into(out)
    records = [FileRecord(rel, len(data), file_checksum(out / rel)) for rel, data in files.items()]
    remove_owned(out, [*records, FileRecord("presharded", 0, "")])
    assert dumped(out) == files


def test_inspect_describes_the_conversion_as_without_the_dump(out, tiny_converted):
    before = json.loads(run_cli("inspect", out, "--json").stdout)
    files = dump_into(out)
    after = json.loads(run_cli("inspect", out, "--json").stdout)
    assert after == before
    assert json.loads(run_cli("inspect", tiny_converted, "--json").stdout)["kind"] == after["kind"]
    assert dumped(out) == files


def test_verify_passes_and_names_nothing_of_the_dump(out, tiny_ckpt):
    files = dump_into(out)
    result = run_cli("verify", out, "--source", tiny_ckpt, "--json")
    report = json.loads(result.stdout)
    assert report["ok"] and not report["problems"], report
    assert "presharded" not in result.stdout + result.stderr
    assert dumped(out) == files


def test_verify_still_reports_a_stray_weight_file_beside_the_dump(out):
    """The rule is the folder's, not a file name's: an unlisted shard elsewhere is still found."""
    dump_into(out)
    rank = out / "rank-00000-of-00004"
    shutil.copy(rank / "layers.0.safetensors", rank / "layers.9.safetensors")
    result = run_cli("verify", out, "--json", check=False)
    assert result.returncode != 0 and "layers.9.safetensors" in result.stdout
    assert "presharded" not in result.stdout


def test_a_rerun_of_convert_resumes_beside_the_dump(out, tiny_ckpt):
    files = dump_into(out)
    run_cli("convert", tiny_ckpt, out, "--ep-size", 4, "--num-redundant-experts", 4)
    assert dumped(out) == files
    run_cli("verify", out)


def test_convert_overwrite_replaces_the_conversion_and_keeps_the_dump(out, tiny_ckpt):
    files = dump_into(out)
    refused = run_cli("convert", tiny_ckpt, out, "--ep-size", 2, check=False)
    assert refused.returncode == 2 and dumped(out) == files
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "--overwrite")
    assert dumped(out) == files
    assert not any(out.glob("rank-*-of-00004"))
    run_cli("verify", out)


def test_push_never_publishes_the_dump(out, tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "server").install(monkeypatch, tmp_path / "cache")
    dump_into(out)
    run_cli("push", out, REPO_ID)
    published = set(hub.files(REPO_ID))
    assert published and not any(name.startswith("presharded/") for name in published)
    assert "manifest.json" in published


def test_pull_leaves_a_dump_in_its_local_dir(out, tmp_path, monkeypatch):
    """A node that pulled its ranks and served them with presharded pulls again (another revision,
    other ranks): the dump stays, and the pulled folder verifies."""
    FakeHub(tmp_path / "server").install(monkeypatch, tmp_path / "cache")
    run_cli("push", out, REPO_ID)
    local = tmp_path / "node"
    run_cli("pull", REPO_ID, "--ranks", "0-1", "--local-dir", local)
    files = dump_into(local)
    run_cli("pull", REPO_ID, "--ranks", "0-3", "--local-dir", local)
    assert dumped(local) == files
    run_cli("verify", local)
