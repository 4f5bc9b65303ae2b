"""Full disks, bad input, failing writes and held locks never yield a wrong or half-written model.

Faults are injected through ``MEGAMOE_TEST_FAULTS`` (megamoe_convert/faults.py) into real CLI runs;
every outcome is checked against a clean run. Kills, Ctrl-C and runs side by side, which need
processes of their own: tests/e2e/test_crashes.py and tests/e2e/test_concurrent_runs.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import typer
from conftest import REPO, output_files, run_cli
from damage import CONVERT_ARGS
from filelock import FileLock
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from megamoe_convert.cli._run import run_command
from megamoe_convert.convert.fleet import auto_merge, merge
from megamoe_convert.errors import LoadError, ManifestError, MegamoeError, OutputBusy, PlacementError
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import part_name
from megamoe_convert.output.seal import seal
from megamoe_convert.output.writer import AtomicWriter, partial_path
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.source.safetensors_io import SafetensorsError, read_header
from megamoe_convert.synth.write import synthesize
from megamoe_convert.verify import verify


def assert_refused_as_unfinished(out: Path) -> None:
    assert not (out / "manifest.json").exists()
    with pytest.raises(MegamoeError, match="not a finished megamoe conversion"):
        load_rank(out, 0)
    report = verify(out)
    assert not report.ok and "not a finished megamoe conversion" in str(report.problems[0])


# ----------------------------------------------------------------------------- disk full


def test_disk_full_is_a_clear_error_and_resumes_cleanly(tiny_ckpt, tmp_path, clean):
    out = tmp_path / "out"
    proc = run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS, check=False,
                   env={"MEGAMOE_TEST_FAULTS": "enospc-after-bytes=900000"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "No space left on device" in error and ".safetensors" in error
    assert "rerun the same command" in error
    assert_refused_as_unfinished(out)
    assert not list(out.rglob(".*.partial")), "a failed write must not leave its temporary file"
    run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS)  # space freed: same command resumes
    assert output_files(out) == clean[0]


def test_disk_full_hint_to_resume_is_only_given_by_commands_that_resume(tmp_path):
    proc = run_cli("synth", tmp_path / "ckpt", check=False, env={"MEGAMOE_TEST_FAULTS": "enospc-after-bytes=100000"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and error.endswith("No space left on device") and ".safetensors" in error


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_commit_errors_name_the_file_and_leave_no_temporary_file(tmp_path, monkeypatch, capsys, failing):
    final = tmp_path / "rank-00000-of-00001" / "layers.0.safetensors"

    def write() -> None:
        with AtomicWriter(final, tmp_path) as w:
            w.write(b"x" * 100)
            w.commit()

    def fail(*args: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError) as info:
        write()
    assert info.value.errno == errno.EIO and info.value.filename == str(final)
    assert not final.exists() and not partial_path(final).exists()
    with pytest.raises(typer.Exit):
        run_command(write)
    assert capsys.readouterr().err == f"error: {final}: {os.strerror(errno.EIO)}\n"


def test_journal_write_errors_name_the_journal(tmp_path, monkeypatch):
    from megamoe_convert.output.resume import OutputState
    from megamoe_convert.output.writer import FileRecord

    state = OutputState(tmp_path)
    state.dir.mkdir()

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        state.record(FileRecord("rank-00000-of-00001/layers.0.safetensors", 1, "00"))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(state.journal_path)


# ----------------------------------------------------------------------------- bad input


def rewrite_shard_of(src: Path, name: str, edit) -> None:
    """Rewrite the shard holding ``name`` with ``edit(tensors)`` applied; keep the index in sync."""
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = src / index["weight_map"][name]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard.name or n in tensors}
    index["weight_map"].update({n: shard.name for n in tensors})
    index_path.write_text(json.dumps(index))


def first_shard(src: Path) -> Path:
    return src / "model-00001-of-00016.safetensors"


def edit_config(src: Path, **changes) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))


def shard_with(src: Path, name: str) -> str:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]


W1 = "layers.1.ffn.experts.2.w1.weight"
S3 = "layers.0.ffn.experts.5.w3.scale"

BAD_INPUTS = {
    "truncated shard": (lambda s: (s / shard_with(s, W1)).write_bytes((s / shard_with(s, W1)).read_bytes()[:-1000]),
                        (), r"model-000\d\d-of-00016.safetensors: truncated: header needs \d+ bytes, file has \d+"),
    "corrupted header": (lambda s: (s / shard_with(s, W1)).write_bytes(
                             b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!}"
                             + (s / shard_with(s, W1)).read_bytes()[24:]),
                         (), r"safetensors: corrupted safetensors header"),
    "index points at a missing file": (lambda s: (s / shard_with(s, W1)).unlink(), (),
                                       r"index points at missing file model-000\d\d-of-00016.safetensors"),
    "missing expert tensor": (lambda s: rewrite_shard_of(s, W1, lambda t: t.pop(W1)), (),
                              r"missing expert tensor layers.1.ffn.experts.2.w1.weight"),
    "duplicated tensor": (lambda s: rewrite_shard_of(s, "embed.weight",
                                                     lambda t: t.update({W1: torch.zeros(128, 128, dtype=torch.int8)})),
                          (), r"duplicated tensor layers.1.ffn.experts.2.w1.weight in model-000\d\d"),
    "unknown expert tensor": (lambda s: rewrite_shard_of(s, W1, lambda t: t.update(
                                  {"layers.1.ffn.experts.2.w4.weight": t[W1].clone()})), (),
                              r"unexpected expert tensor layers.1.ffn.experts.2.w4.weight \(expected "),
    "wrong dtype": (lambda s: rewrite_shard_of(s, S3, lambda t: t.update({S3: t[S3].view(torch.uint8).float()})), (),
                    r"layers.0.ffn.experts.5.w3.scale has dtype F32, expected one of F8_E8M0, U8"),
    "wrong shape": (lambda s: rewrite_shard_of(s, W1, lambda t: t.update({W1: t[W1][:, :64].contiguous()})), (),
                    r"layers.1.ffn.experts.2.w1.weight has shape \[128, 64\], expected \[128, 128\]"),
    "config disagrees with the tensors (hidden size)": (lambda s: edit_config(s, hidden_size=512), (),
                                                        r"has shape \[128, 128\], expected \[128, 256\] "
                                                        r"\(hidden_size=512"),
    "config disagrees with the tensors (experts)": (lambda s: edit_config(s, n_routed_experts=6), (),
                                                    r"names expert 6, but config.json has n_routed_experts=6"),
    "config disagrees with the tensors (layers)": (lambda s: edit_config(s, num_hidden_layers=3), (),
                                                   r"num_hidden_layers=3 but the checkpoint has experts for decoder "
                                                   r"layers 0-1"),
    "H not a multiple of 128": (lambda s: edit_config(s, hidden_size=320), (),
                                r"config.json: hidden_size=320 must be a positive multiple of 128"),
    "I not a multiple of 128": (lambda s: edit_config(s, moe_intermediate_size=96), (),
                                r"config.json: moe_intermediate_size=96 must be a positive multiple of 128"),
    "impossible ep_size": (lambda s: None, ("--ep-size", 3),
                           r"n_routed_experts \(8\) \+ num_redundant_experts \(0\) = 8 is not divisible by ep_size=3"),
    "impossible redundancy": (lambda s: None, ("--ep-size", 4, "--num-redundant-experts", 2),
                              r"= 10 is not divisible by ep_size=4"),
    "placement missing a logical expert": (lambda s: (s / "p.json").write_text(json.dumps([0, 1, 2, 3, 4, 5, 6, 6])),
                                           ("--ep-size", 2, "--placement", "{src}/p.json"),
                                           r"p.json: logical experts \[7\] have no physical slot"),
    "no config": (lambda s: (s / "config.json").unlink(), (), r"src: not a checkpoint directory \(no config.json\)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_clear_line_and_leaves_nothing_that_looks_valid(tiny_ckpt, tmp_path, case):
    mutate, extra, message = BAD_INPUTS[case]
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    mutate(src)
    out = tmp_path / "out"
    args = [str(a).format(src=src) for a in (extra or ("--ep-size", 2))]
    proc = run_cli("convert", src, out, *args, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    import re
    assert re.search(message, lines[0]), lines[0]
    assert not (out / "manifest.json").exists()
    assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.rglob("*"))


def test_debug_flag_shows_the_traceback(tiny_ckpt, tmp_path):
    proc = run_cli("--debug", "convert", tiny_ckpt, tmp_path / "o", "--ep-size", 3, check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "PlacementError" in proc.stderr


def test_output_on_a_read_only_path_is_a_clear_error(tiny_ckpt, tmp_path):
    if os.geteuid() == 0:
        target = Path("/proc/megamoe-out")  # a read-only file system even for root
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target = ro / "out"
    proc = run_cli("convert", tiny_ckpt, target, "--ep-size", 2, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(target) in line


def test_output_path_that_is_a_file_is_refused(tiny_ckpt, tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = run_cli("convert", tiny_ckpt, tmp_path / "afile", "--ep-size", 2, check=False)
    assert proc.returncode == 2 and "exists and is not a directory" in proc.stderr


# ----------------------------------------------------------------------------- loader side


def test_loader_refuses_a_shard_of_another_model(tiny_ckpt, tiny_converted, tmp_path):
    other = tmp_path / "other"
    synthesize(other, "tiny", seed=9)
    run_cli("convert", other, tmp_path / "other-out", "--ep-size", 4, "--num-redundant-experts", 4)
    out = tmp_path / "mixed"
    shutil.copytree(tiny_converted, out)
    # A same-shaped shard from another checkpoint passes structure checks: the source comparison catches it.
    rel = "rank-00001-of-00004/layers.0.safetensors"
    shutil.copy(tmp_path / "other-out" / rel, out / rel)
    with pytest.raises(LoadError, match="checksum mismatch"):
        load_rank(out, 1, verify=True)
    # A shard of a model with other dims is refused, even with a forged (re-sealed) manifest entry.
    small = tmp_path / "small"
    config = json.loads((REPO / "configs" / "tiny.json").read_text())
    config.update(hidden_size=128)
    (tmp_path / "h128.json").write_text(json.dumps(config))
    synthesize(small, str(tmp_path / "h128.json"), seed=3)
    run_cli("convert", small, tmp_path / "small-out", "--ep-size", 4, "--num-redundant-experts", 4)
    shutil.copy(tmp_path / "small-out" / rel, out / rel)
    manifest = json.loads((out / "manifest.json").read_text())
    for record in manifest["files"]:
        if record["path"] == rel:
            record["size"] = (out / rel).stat().st_size
    (out / "manifest.json").write_text(seal(manifest))
    # The forged record now contradicts the manifest's own dims: refused before the shard is opened.
    with pytest.raises(MegamoeError, match=rf"{rel}: listed with size \d+, its dims and placement give \d+"):
        load_rank(out, 1)


# ----------------------------------------------------------------------------- concurrency


def test_merge_waits_for_no_part_and_no_part_for_a_merge(tiny_ckpt, tmp_path, clean):
    """A merge refuses while any part holds its lock (an automatic merge leaves it to that part),
    and a part refuses while a merge holds OUT."""
    out = tmp_path / "out"
    for part in ("0/2", "1/2"):
        run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS, "--shard", part)
    part_lock = FileLock(out / ".megamoe" / part_name(0, 2) / "lock")
    with part_lock.acquire(timeout=0):
        with pytest.raises(OutputBusy, match="part 0/2 of a split conversion is being written"):
            merge(out)
        assert auto_merge(out) is False
    with FileLock(out / ".megamoe" / "lock").acquire(timeout=0):
        refused = run_cli("convert", tiny_ckpt, out, *CONVERT_ARGS, "--shard", "1/2", check=False)
    assert refused.returncode == 2 and "a `megamoe convert` without --shard or a `megamoe merge`" in refused.stderr
    assert merge(out)["parts"] == 2
    assert output_files(out) == clean[0]


# ----------------------------------------------------------------------------- fuzzing the readers


def valid_shard_bytes(tmp: Path) -> bytes:
    path = tmp / "valid.safetensors"
    save_file({"a": torch.arange(12, dtype=torch.int32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)},
              path, metadata={"k": "v"})
    return path.read_bytes()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzz_shard_header_reader_only_raises_its_own_error(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("fuzz")
    base = bytearray(valid_shard_bytes(tmp))
    mode = data.draw(st.sampled_from(["flip", "truncate", "random", "length"]))
    if mode == "flip":
        for i in data.draw(st.lists(st.integers(0, len(base) - 1), min_size=1, max_size=8)):
            base[i] = data.draw(st.integers(0, 255))
    elif mode == "truncate":
        base = base[:data.draw(st.integers(0, len(base) - 1))]
    elif mode == "random":
        base = bytearray(data.draw(st.binary(max_size=400)))
    else:
        base[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    path = tmp / "fuzzed.safetensors"
    path.write_bytes(bytes(base))
    try:
        header = read_header(path)
    except SafetensorsError as e:
        assert str(path) in str(e)
        return
    # Anything accepted is self-consistent: tensors tile the data exactly, inside the file.
    assert sum(t.nbytes for t in header.tensors.values()) == header.file_size - header.data_start


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats(allow_nan=False)
                           | st.text(max_size=8),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=12), inner, max_size=6)),
                           max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzz_manifest_reader_raises_only_manifest_or_placement_errors(tiny_converted, data):
    valid = json.loads((tiny_converted / "manifest.json").read_text())
    mode = data.draw(st.sampled_from(["random", "drop", "replace"]))
    if mode == "random":
        doc = data.draw(json_values)
    else:
        doc = json.loads(json.dumps(valid))
        key = data.draw(st.sampled_from(sorted(doc)))
        if mode == "drop":
            del doc[key]
        else:
            doc[key] = data.draw(json_values)
    try:
        manifest = Manifest.from_json(doc, sealed=False)  # the fields, not just the checksum
    except (ManifestError, PlacementError):  # the placement object is its own parser's
        return
    assert isinstance(manifest.ranks, list) and manifest.placement.ep_size >= 1


def test_corrupted_manifest_text_is_refused(tiny_converted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(tiny_converted, out)
    (out / "manifest.json").write_text('{"format": "megamoe-convert", "format_version": 1,')
    with pytest.raises(ManifestError, match="manifest.json: invalid JSON"):
        read_manifest(out)
    with pytest.raises(MegamoeError, match="manifest.json: invalid JSON"):
        load_rank(out, 0)


def test_source_shrinking_during_the_run_is_an_error_naming_the_file(tiny_ckpt, tmp_path, monkeypatch):
    """Headers were fine when the plan was made; the file is cut short before its bytes are read."""
    from megamoe_convert.convert import run as convert_module

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(tiny_ckpt, src)
    victim = max(src.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    real_build_plan = convert_module.build_plan

    def plan_then_truncate(*args, **kwargs):
        plan = real_build_plan(*args, **kwargs)
        os.truncate(victim, victim.stat().st_size // 2)
        return plan

    monkeypatch.setattr(convert_module, "build_plan", plan_then_truncate)
    options = convert_module.ConvertOptions(ep_size=2, fsync=False)
    with pytest.raises(SafetensorsError, match=rf"{victim.name}: unexpected end of file at byte \d+"):
        convert_module.convert(src, out, options)
    assert not (out / "manifest.json").exists() and not list(out.rglob("*.partial"))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped exception, on purpose
def test_a_ctrl_c_whose_keyboardinterrupt_python_dropped_still_stops_the_run():
    """Python drops a KeyboardInterrupt raised inside a finalizer (it prints "Exception ignored in"),
    which let a Ctrl-C'd conversion run on to exit 0 (seen once in CI under load). The handler also
    records the stop, and the conversion loop stops on the record."""
    import types

    from megamoe_convert import interrupts
    from megamoe_convert.convert import run as run_module
    from megamoe_convert.progress import NoProgress

    class RaisesInItsFinalizer:
        def __del__(self) -> None:
            interrupts._on_sigint(signal.SIGINT, None)  # as if the signal arrived here: Python drops it

    ran = []

    def unit(i: int) -> types.SimpleNamespace:
        def run() -> types.SimpleNamespace:
            ran.append(i)
            if i == 0:
                RaisesInItsFinalizer()  # made and collected at once: its __del__ runs, the exception is dropped
            time.sleep(0.3)
            return types.SimpleNamespace(path=f"unit{i}", size=1)
        return types.SimpleNamespace(path=f"unit{i}", nbytes=1, run=run)

    state = types.SimpleNamespace(record=lambda record: None)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_module._run_units([unit(i) for i in range(8)], state, {}, NoProgress(), threading.Event(), workers=1)
    finally:
        interrupts.clear()
    assert len(ran) < 8, "the run went on after the Ctrl-C"
