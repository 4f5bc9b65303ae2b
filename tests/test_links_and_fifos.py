"""Reliability III (issue 24), part 1: never write through a link (N1), `verify --source` compares
every tensor a kernel reads and the family (N2-N5), JSON inputs never hang (N6). Every test is a
reproduction from the issue: real files, real CLI subprocesses (`run_cli`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from megamoe_convert.errors import MegamoeError
from megamoe_convert.loader import LoadError, load_rank
from megamoe_convert.output.compare import same_values
from megamoe_convert.output.seal import seal
from megamoe_convert.output.writer import file_checksum
from megamoe_convert.source.safetensors_io import read_header
from megamoe_convert.synth import synthesize

EP2 = ("--ep-size", 2, "--no-fsync")
RANK0 = "rank-00000-of-00002"


def one_line_refusal(proc, *needles: str) -> None:
    """Exit 2, and on stderr exactly one line ``error: ...`` holding every needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: ") and all(n in proc.stderr for n in needles), proc.stderr


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """tiny (MXFP4 + fused shared expert), a one-layer NVFP4 tiny, and DeepSeek-V4.1 tiny."""
    root = tmp_path_factory.mktemp("sources")
    kinds = {"mx": dict(preset="tiny"), "v41": dict(preset="v4.1-tiny"),
             "nv": dict(preset="tiny", experts=4, layers=1, mtp_layers=0, weight_format="nvfp4")}
    for name, kw in kinds.items():
        synthesize(root / name, seed=1, **kw)
    return {name: root / name for name in kinds}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    for name, src in sources.items():
        run_cli("convert", src, root / name, *EP2)
    return {name: root / name for name in sources}


def copy(path: Path, tmp_path: Path, name: str = "out") -> Path:
    shutil.copytree(path, tmp_path / name, symlinks=True)
    return tmp_path / name


def reseal(out: Path, edit=None) -> None:
    """Recompute every listed file's size and checksum and the manifest's seal (``edit``: change
    the manifest's fields first): only a comparison with the source can then tell."""
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("manifest_checksum", None)
    for item in manifest["files"]:
        path = out / item["path"]
        item["size"], item["checksum"] = path.stat().st_size, file_checksum(path)
    if edit:
        edit(manifest)
    (out / "manifest.json").write_text(seal(manifest))


def poke(path: Path, tensor: str, data: bytes) -> None:
    """Overwrite the first bytes of ``tensor`` in a safetensors file, in place."""
    entry = read_header(path).tensors[tensor]
    assert len(data) <= entry.nbytes
    with open(path, "r+b") as f:
        f.seek(entry.begin)
        f.write(data)


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def problems(proc) -> list[str]:
    return [line.strip()[2:] for line in proc.stdout.splitlines() if line.strip().startswith("- ")]


# ----------------------------------------------------------------------------- N1 links


def test_n1_a_linked_rank_folder_is_never_written_through(converted, tmp_path):
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


def test_n1_after_a_killed_run_the_rerun_never_writes_through_a_link(sources, tmp_path):
    out = tmp_path / "out"
    killed = run_cli("convert", sources["mx"], out, *EP2, "--workers", 1, check=False,
                     env={"MEGAMOE_FAULT": "kill-after-files=4"})
    assert killed.returncode == -9 and not (out / "manifest.json").exists()
    victim = tmp_path / "v"
    victim.mkdir()
    (victim / "layers.1.safetensors").write_text("precious")
    shutil.rmtree(out / RANK0, ignore_errors=True)
    (out / RANK0).symlink_to(victim)
    one_line_refusal(run_cli("convert", sources["mx"], out, *EP2, check=False), RANK0, "symbolic link")
    assert [p.read_text() for p in victim.iterdir()] == ["precious"]
    (out / RANK0).unlink()  # the user removes the link: the rerun finishes the conversion
    run_cli("convert", sources["mx"], out, *EP2)
    assert run_cli("verify", out, "--source", sources["mx"]).returncode == 0


def test_n1_a_linked_journal_lock_or_state_folder_is_refused(converted, sources, tmp_path):
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


def test_n1_merge_never_writes_through_a_linked_rank_folder(sources, tmp_path):
    parts = [tmp_path / f"p{i}" for i in range(2)]
    for i, part in enumerate(parts):
        run_cli("convert", sources["mx"], part, *EP2, "--shard", f"{i}/2", "--shard-by", "rank")
    out, victim = tmp_path / "out", tmp_path / "v"
    (out / ".megamoe").mkdir(parents=True)  # a megamoe output (an empty one would be as good)
    victim.mkdir()
    (out / RANK0).symlink_to(victim)
    one_line_refusal(run_cli("merge", out, *parts, check=False), RANK0, "symbolic link")
    assert list(victim.iterdir()) == []


def test_n1_a_synth_output_whose_temporary_name_is_a_link_is_refused(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / ".ckpt.partial").symlink_to(target)
    one_line_refusal(run_cli("synth", tmp_path / "ckpt", check=False), ".ckpt.partial", "not made by megamoe synth")
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------- N2-N5 verify --source


@pytest.mark.parametrize("tensor, numerics", [
    ("l2.input_scale", True), ("l2.input_scale_all", True),  # N2: the kernel quantises L2 inputs with them
    ("l1.global_scale", False), ("l2.global_scale", False),  # N3: NVFP4 global scales without --numerics
])
def test_n2_n3_nvfp4_scales_changed_and_resealed_fail_verify_source(converted, sources, tmp_path, tensor, numerics):
    out = copy(converted["nv"], tmp_path)
    rank_file = out / RANK0 / "layers.0.safetensors"
    poke(rank_file, f"layers.0.ffn.experts.{tensor}", f32(7.0))
    reseal(out)
    assert run_cli("verify", out).returncode == 0  # intact as far as the manifest can tell
    proc = run_cli("verify", out, "--source", sources["nv"], *(["--numerics"] if numerics else []), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert problems(proc) == [f"rank 0 layers.0: {tensor} differs from the source"]


@pytest.mark.parametrize("tensor", ["shared_l1.weight", "shared_l1.sf", "shared_l2.weight", "shared_l2.sf"])
def test_n3_a_zeroed_fused_shared_expert_fails_verify_source(converted, sources, tmp_path, tensor):
    out = copy(converted["mx"], tmp_path)
    path = out / "rank-00001-of-00002" / "mtp.0.safetensors"
    entry = read_header(path).tensors[f"mtp.0.ffn.experts.{tensor}"]
    poke(path, entry.name, bytes(entry.nbytes))
    reseal(out)
    proc = run_cli("verify", out, "--source", sources["mx"], check=False)
    assert proc.returncode == 1 and problems(proc) == [f"rank 1 mtp.0: {tensor} differs from the source"]
    assert "extra tensors vs source" in proc.stdout


def test_n3_verify_source_passes_an_untouched_conversion_and_counts_every_extra_tensor(converted, sources):
    for name in ("mx", "nv", "v41"):
        proc = run_cli("verify", converted[name], "--source", sources[name], "--numerics", "--json")
        report = json.loads(proc.stdout)
        assert report["ok"] and report["checks"]["extra_tensors_vs_source"] > 0, report


def test_n4_a_relabelled_family_fails_verify_and_load_rank(converted, sources, tmp_path):
    out = copy(converted["v41"], tmp_path)
    reseal(out, lambda m: m.update(family="kimi_k3"))
    proc = run_cli("verify", out, "--source", sources["v41"], "--numerics", check=False)
    assert proc.returncode == 1
    found = problems(proc)
    assert "manifest.json: family is 'kimi_k3', but the source is DeepSeek-V4.1 ('deepseek_v41')" in found
    assert any("config.json is DeepSeek-V4.1's" in p for p in found)  # also at the integrity level
    with pytest.raises(LoadError, match="family is 'kimi_k3'.*DeepSeek-V4.1"):
        load_rank(out, 0)


def _nvfp4_source_with(sources, tmp_path, tensor: str, value: float) -> Path:
    src = copy(sources["nv"], tmp_path, "src")
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    poke(src / weight_map[tensor], tensor, f32(value))
    return src


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -0.5])
@pytest.mark.parametrize("tensor", ["layers.0.ffn.experts.2.w1.weight_scale_2", "layers.0.ffn.experts.3.w2.input_scale"])
def test_n5_a_non_finite_or_non_positive_global_scale_is_a_source_problem(sources, tmp_path, value, tensor):
    src = _nvfp4_source_with(sources, tmp_path, tensor, value)
    if tensor.endswith("w1.weight_scale_2"):  # w3's must stay equal to w1's, or that is the refusal
        poke(src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][
            tensor.replace("w1", "w3")], tensor.replace("w1", "w3"), f32(value))
    proc = run_cli("convert", src, tmp_path / "out", *EP2, check=False)
    one_line_refusal(proc, tensor, "finite and positive", "source checkpoint")
    assert not (tmp_path / "out" / "manifest.json").exists() and not list((tmp_path / "out").glob("rank-*"))


def test_n5_numerics_gives_no_false_verdict_on_nan_and_refuses_an_absurd_scaling_factor(converted, sources,
                                                                                        tmp_path):
    # A NaN scale on both sides (bytes equal): a source problem, never "the layout differs".
    tensor = "layers.0.ffn.experts.0.w2.input_scale"
    src = _nvfp4_source_with(sources, tmp_path, tensor, math.nan)
    proc = run_cli("verify", converted["nv"], "--source", src, "--numerics", check=False)
    assert proc.returncode == 1
    assert all("finite and positive" in p for p in problems(proc)) and "differs" not in proc.stdout
    assert same_values(torch.tensor([math.nan, 1.0]), torch.tensor([math.nan, 1.0]))
    assert not same_values(torch.tensor([math.nan, 1.0]), torch.tensor([1.0, 1.0]))
    # routed_scaling_factor 1e300 on a correct conversion: refused as a source problem, in one line.
    src = copy(sources["mx"], tmp_path, "src-mx")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "routed_scaling_factor": 1e300}))
    one_line_refusal(run_cli("verify", converted["mx"], "--source", src, "--numerics", check=False),
                     "routed_scaling_factor", "out of range", "source checkpoint")


# ----------------------------------------------------------------------------- N6 FIFOs


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def test_n6_a_fifo_manifest_never_hangs(converted, tmp_path):
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
def test_n6_a_fifo_in_the_source_never_hangs(converted, sources, tmp_path, name):
    src = copy(sources["mx"], tmp_path, "src")
    _fifo(src / name)
    for args in (("convert", src, tmp_path / "new", *EP2), ("inspect", src),
                 ("verify", converted["mx"], "--source", src)):
        one_line_refusal(run_cli(*args, check=False, timeout=60), name, "is a FIFO, not a regular file")
