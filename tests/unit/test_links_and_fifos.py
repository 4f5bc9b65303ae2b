"""The tool never writes through a symbolic link and never blocks on a FIFO: real files, real CLI
subprocesses (`run_cli`)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from conftest import run_cli
from damage import EP2, RANK0, copy, one_line_refusal, problems

from megamoe_convert import load_rank
from megamoe_convert.errors import MegamoeError

# ----------------------------------------------------------------------------- links


def test_a_linked_rank_folder_is_never_written_through(converted, tmp_path):
    """`rank-*` replaced by a link to the user's folder: a plain rerun refuses in one line before it
    changes anything (the manifest stays), and the user's file keeps its bytes."""
    out = copy(converted["mx"], tmp_path)
    victim = tmp_path / "v"
    victim.mkdir()
    (victim / "layers.0.safetensors").write_text("precious")
    shutil.rmtree(out / RANK0)
    (out / RANK0).symlink_to(victim)
    proc = run_cli("convert", tmp_path.parent / "x", out, *EP2, check=False)  # wrong SRC: refused first
    assert proc.returncode == 2
    src = Path(json.loads((out / "manifest.json").read_text())["source"]["path"])
    proc = run_cli("convert", src, out, *EP2, check=False)
    one_line_refusal(proc, RANK0, "symbolic link", "never through a link")
    assert (victim / "layers.0.safetensors").read_text() == "precious"
    assert sorted(p.name for p in victim.iterdir()) == ["layers.0.safetensors"]  # not even a temporary file
    assert (out / "manifest.json").exists()  # refused before anything in OUT changed
    proc = run_cli("convert", src, out, *EP2, "--overwrite", check=False)
    one_line_refusal(proc, "symbolic link")
    assert (victim / "layers.0.safetensors").read_text() == "precious"


def test_a_linked_journal_lock_or_state_folder_is_refused(converted, sources, tmp_path):
    out = copy(converted["mx"], tmp_path)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("mine\n")
    journal = out / ".megamoe" / "journal.jsonl"
    journal.unlink()
    journal.symlink_to(elsewhere)
    one_line_refusal(run_cli("convert", sources["mx"], out, *EP2, check=False), "journal", "symbolic link")
    assert elsewhere.read_text() == "mine\n" and (out / "manifest.json").exists()
    journal.unlink()
    lock = out / ".megamoe" / "lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(elsewhere)  # a lock file is opened with O_TRUNC
    one_line_refusal(run_cli("convert", sources["mx"], out, *EP2, check=False), "lock", "symbolic link")
    assert elsewhere.read_text() == "mine\n"


def test_merge_never_writes_through_a_linked_rank_folder(sources, tmp_path):
    parts = [tmp_path / f"p{i}" for i in range(2)]
    for i, part in enumerate(parts):
        run_cli("convert", sources["mx"], part, *EP2, "--shard", f"{i}/2", "--shard-by", "rank")
    out, victim = tmp_path / "out", tmp_path / "v"
    (out / ".megamoe").mkdir(parents=True)  # a megamoe output (an empty one would be as good)
    victim.mkdir()
    (out / RANK0).symlink_to(victim)
    one_line_refusal(run_cli("merge", out, *parts, check=False), RANK0, "symbolic link")
    assert list(victim.iterdir()) == []


def test_a_synth_output_whose_temporary_name_is_a_link_is_refused(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / ".ckpt.partial").symlink_to(target)
    one_line_refusal(run_cli("synth", tmp_path / "ckpt", check=False), ".ckpt.partial", "not made by megamoe synth")
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------- FIFOs


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def test_a_fifo_manifest_never_hangs(converted, tmp_path):
    out = copy(converted["mx"], tmp_path)
    _fifo(out / "manifest.json")
    result: list[BaseException] = []
    thread = threading.Thread(target=lambda: result.append(pytest.raises(MegamoeError, load_rank, out, 0).value),
                              daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "load_rank blocked on a FIFO"
    assert "is a FIFO, not a regular file" in str(result[0])
    proc = run_cli("verify", out, check=False, timeout=60)
    assert proc.returncode == 1 and any("is a FIFO" in p for p in problems(proc))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_fifo_in_the_source_never_hangs(converted, sources, tmp_path, name):
    src = copy(sources["mx"], tmp_path, "src")
    _fifo(src / name)
    for args in (("convert", src, tmp_path / "new", *EP2), ("inspect", src),
                 ("verify", converted["mx"], "--source", src)):
        one_line_refusal(run_cli(*args, check=False, timeout=60), name, "is a FIFO, not a regular file")
