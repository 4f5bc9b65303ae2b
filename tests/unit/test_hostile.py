"""Hostile and damaged inputs: nothing outside what the tool wrote is ever deleted,
nothing stale or foreign reads as finished, every bad file is one line and exit 2, every
range and count is bounded before it is expanded. Real files, real CLI runs; the
fuzzers run in-process (many examples) and assert the same contract on the error types the
CLI turns into one line."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from megamoe_convert.cli import app
from megamoe_convert.cli._run import HANDLED_ERRORS
from megamoe_convert.errors import LoadError, ManifestError, MegamoeError
from megamoe_convert.layout.placement import Placement, PlacementError
from megamoe_convert.output.manifest import read_manifest
from megamoe_convert.output.resume import OutputState
from megamoe_convert.output.seal import seal
from megamoe_convert.serve.loader import load_rank
from megamoe_convert.synth.write import synthesize
from megamoe_convert.verify import verify

EP2 = ("--ep-size", 2)
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def ep2(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_ckpt`` converted for EP 2. Read-only: tests copy it."""
    out = tmp_path_factory.mktemp("hostile") / "ep2"
    run_cli("convert", tiny_ckpt, out, *EP2, "--no-fsync")
    return out


def copy_of(ep2: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(ep2, out)
    return out


def one_line_refusal(proc: Any, *needles: str) -> None:
    """Exit 2, and on stderr exactly one line ``error: ...`` holding every needle."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: ") and all(n in proc.stderr for n in needles), proc.stderr


def run_in_process(*args: object, check: bool = False) -> Any:
    """The CLI run in this process (no interpreter start-up): for the many small refusal cases;
    the same cases through a real subprocess are covered by one of each kind below."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return SimpleNamespace(returncode=result.exit_code, stderr=result.stderr)


def journal_line(path: str, size: int = 1, checksum: str = "0" * 32) -> str:
    return json.dumps({"path": path, "size": size, "checksum": checksum}) + "\n"


# ----------------------------------------------------------------------------- data loss


def test_overwrite_deletes_only_what_the_tool_wrote(ep2, tiny_ckpt, tmp_path):
    out = copy_of(ep2, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("outside OUT")
    (out / "rank-sweep-of-ep-sizes").mkdir()
    (out / "rank-sweep-of-ep-sizes" / "results.csv").write_text("mine")
    (out / "rank-00000-of-00002" / "notes.txt").write_text("mine too")
    (out / "notes.md").write_text("same name as a journaled small file, other bytes")
    with open(out / ".megamoe" / "journal.jsonl", "a") as f:  # forged: escapes, absolute, a user file
        f.write(journal_line("../victim.txt", 11) + journal_line(str(victim), 11) + journal_line("notes.md", 49))
    run_cli("convert", tiny_ckpt, out, "--ep-size", 4, "--overwrite", "--no-fsync")
    assert victim.read_text() == "outside OUT"
    assert (out / "rank-sweep-of-ep-sizes" / "results.csv").read_text() == "mine"
    assert (out / "rank-00000-of-00002" / "notes.txt").read_text() == "mine too"
    assert (out / "notes.md").exists()
    assert not list((out / "rank-00000-of-00002").glob("*.safetensors"))  # the old rank shards went
    assert not (out / "rank-00001-of-00002").exists()
    assert read_manifest(out).ep_size == 4


def test_a_corrupt_journal_costs_a_redo_never_the_model(ep2, tiny_ckpt, tmp_path):
    out = copy_of(ep2, tmp_path)
    journal = out / ".megamoe" / "journal.jsonl"
    data = bytearray(journal.read_bytes())
    data[len(data) // 2] = 0xFF  # one byte: that line is no longer UTF-8
    journal.write_bytes(bytes(data))
    proc = run_cli("convert", tiny_ckpt, out, *EP2, "--no-fsync", "--json")
    assert json.loads(proc.stdout)["files_written"] == 1  # the damaged line's file, and only it
    journal.write_bytes(b"\xff\xfe" + os.urandom(64))
    run_cli("convert", tiny_ckpt, out, *EP2, "--no-fsync", "--overwrite")
    assert run_cli("verify", out, check=False).returncode == 0


# ----------------------------------------------------------------------------- stale or foreign bytes


def test_another_source_into_an_out_without_a_source_record_is_refused(ep2, tmp_path):
    out = copy_of(ep2, tmp_path)
    (out / ".megamoe" / "source.json").unlink()  # as `megamoe merge` of parts of several machines leaves it
    other = tmp_path / "other"
    synthesize(other, "tiny", seed=2)  # same structure, other bytes
    one_line_refusal(run_cli("convert", other, out, *EP2, check=False), "has no record of the source", "--overwrite")
    assert read_manifest(out).source["path"] != str(other.resolve())


def test_a_manifest_in_the_source_is_never_copied(tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    (src / "manifest.json").write_text('{"format": "megamoe-convert"}')
    run_cli("convert", src, tmp_path / "out", *EP2, "--no-fsync")
    assert run_cli("verify", tmp_path / "out", check=False).returncode == 0


def last_rank_file(manifest: dict) -> dict:
    return [f for f in manifest["files"] if f["path"].startswith("rank-")][-1]


@pytest.mark.parametrize("edit, expected", [
    (lambda m: m["layers"].append(m["layers"][0]), ["layer layers.0 listed twice"]),
    (lambda m: m["ranks"].append(1), ["rank 1 listed twice"]),
    (lambda m: m.update(layers=[]), ["no layers listed", "not a rank x layer of this conversion"]),
    (lambda m: m["files"].remove(last_rank_file(m)), ["is not listed"]),
    (lambda m: last_rank_file(m).update(size=last_rank_file(m)["size"] + 1), ["its dims and placement give"]),
])
def test_a_manifest_that_contradicts_itself_is_refused_and_verify_lists_why(ep2, tmp_path, edit, expected):
    out = copy_of(ep2, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(seal(manifest))
    proc = run_cli("verify", out, check=False)
    assert proc.returncode == 1 and all(e in proc.stdout + proc.stderr for e in expected), proc.stdout
    with pytest.raises(MegamoeError, match=expected[0]):
        load_rank(out, 0)


def test_a_flipped_byte_in_the_manifest_is_caught_by_its_own_checksum(ep2, tmp_path):
    out = copy_of(ep2, tmp_path)
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text.replace('"size": 1', '"size": 2', 1))
    with pytest.raises(MegamoeError, match="manifest_checksum does not match its content"):
        load_rank(out, 0)


# ----------------------------------------------------------------------------- one line, never a traceback


def deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("name, text, needle", [
    ("config.json", deep(100_000), "config.json: invalid JSON"),
    ("config.json", None, "hidden_size' must be an integer, got a list"),
    ("config.json", "NaN", "non-finite number NaN"),
    ("model.safetensors.index.json", '{"weight_map": {"a": ["x"]}}', "a weight_map entry must be a string"),
    ("model.safetensors.index.json", '{"weight_map": {"a": "../x"}}', "is not a file inside the checkpoint"),
    ("p.json", '{"physical_to_logical": [0, 1], "ep_size": 3}', "ep_size is 3, but this conversion has ep_size=2"),
    ("p.json", '[1e999]', "out of range"),
    ("p.json", '["0", "1"]', "expected a JSON list of integer logical expert ids"),
])
def test_hostile_json_is_one_line_naming_the_file(tiny_ckpt, tmp_path, name, text, needle):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    args = [] if name != "p.json" else ["--placement", tmp_path / "p.json"]
    target = tmp_path / "p.json" if name == "p.json" else src / name
    if text is None:
        config = json.loads(target.read_text())
        config["hidden_size"] = [1]
        text = json.dumps(config)
    target.write_text(text)
    run = run_cli if name == "p.json" and "ep_size" in text else run_in_process  # one through a real process
    one_line_refusal(run("convert", src, tmp_path / "out", *EP2, *args, check=False), needle, str(target))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bounded_inputs_and_exact_messages(ep2, tiny_ckpt, tmp_path):
    started = time.monotonic()
    one_line_refusal(run_cli("convert", tiny_ckpt, tmp_path / "o", *EP2, "--layers", "0-20000000", check=False),
                     "'0-20000000' is outside 0..1")
    one_line_refusal(run_in_process("plan", tiny_ckpt, *EP2, "--num-redundant-experts", 999999992),
                     "num_redundant_experts=999999992 is outside")
    one_line_refusal(run_in_process("synth", "."), "cannot replace the current directory")
    assert time.monotonic() - started < 60
    with pytest.raises(LoadError, match="layers=\\[\\]: select at least one"):
        load_rank(ep2, 0, layers=[])
    with pytest.raises(LoadError, match="ep_size must be an int, got '2'"):
        load_rank(ep2, 0, ep_size="2")  # type: ignore[arg-type]
    assert list(load_rank(ep2, 0, layers=iter(["layers.1", "mtp.0"]))) == ["layers.1.ffn.experts", "mtp.0.ffn.experts"]
    with pytest.raises(LoadError, match="is not in this conversion"):
        load_rank(ep2, 0, layers=iter(f"layers.{i}" for i in range(10**12)))


def test_index_paths_and_expert_numbers_are_canonical(tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f"./{v}" for k, v in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    run_cli("convert", src, tmp_path / "out", *EP2, "--no-fsync")
    assert run_cli("verify", tmp_path / "out", "--source", src, check=False).returncode == 0
    name = next(k for k in index["weight_map"] if ".experts.3.w1.weight" in k)
    index["weight_map"][name.replace(".experts.3.", ".experts.03.")] = index["weight_map"].pop(name)
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = run_cli("convert", src, tmp_path / "out2", *EP2, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # the header still names experts.3: refused


# ----------------------------------------------------------------------------- fuzzing


@FUZZ
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzz_manifest_bytes_never_read_as_another_model(ep2, tmp_path_factory, flips, cut):
    out = tmp_path_factory.mktemp("fuzz-manifest") / "out"
    shutil.copytree(ep2, out)
    data = bytearray((out / "manifest.json").read_bytes())
    for where, value in flips:
        data[int(where * len(data))] = value
    if cut is not None:
        data = data[:int(cut * len(data))]
    (out / "manifest.json").write_bytes(bytes(data))
    try:
        manifest = read_manifest(out)
    except (ManifestError, PlacementError) as e:
        assert "\n" not in str(e) and str(out / "manifest.json") in str(e)
        assert not verify(out).ok
        return
    assert manifest.to_json() == read_manifest(ep2).to_json()  # whitespace-only changes read as the same


@FUZZ
@given(journal=st.binary(max_size=400) | st.lists(st.sampled_from([
    "../victim.txt", "/tmp/x", "rank-00000-of-00002/../../victim.txt", "rank-00000-of-00002/notes.txt",
    "notes.txt", ".megamoe/plan.json", "rank-sweep/x", "", "rank-00000-of-00002"]), max_size=6).map(
    lambda paths: "".join(journal_line(p, 5) for p in paths).encode()))
def test_fuzz_journal_clear_deletes_nothing_it_did_not_write(tmp_path_factory, journal):
    root = tmp_path_factory.mktemp("fuzz-journal")
    out = root / "out"
    (out / "rank-00000-of-00002").mkdir(parents=True)
    (out / ".megamoe").mkdir()
    user = [root / "victim.txt", out / "notes.txt", out / "rank-00000-of-00002" / "notes.txt"]
    for path in user:
        path.write_text("mine!")
    (out / ".megamoe" / "journal.jsonl").write_bytes(journal)
    OutputState(out).clear()
    assert all(p.read_text() == "mine!" for p in user)


@FUZZ
@given(doc=st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
                            st.sampled_from(["physical_to_logical", "ep_size", "n_logical", "x"]), kids, max_size=3),
                        max_leaves=12))
def test_fuzz_placement_files_only_raise_placement_errors(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("fuzz-placement") / "p.json"
    path.write_text(json.dumps(doc))
    try:
        placement = Placement.from_file(path, 4, 2)
    except PlacementError as e:
        assert str(path) in str(e) and "\n" not in str(e)
        return
    assert sorted(set(placement.physical_to_logical)) == [0, 1, 2, 3]


@FUZZ
@given(header=st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.integers(-3, 1 << 70) | st.text(max_size=4) | st.floats(),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.sampled_from(["dtype", "shape", "data_offsets"]), kids, max_size=3), max_leaves=8), max_size=4))
def test_fuzz_rank_shard_headers_are_one_line_errors(ep2, tmp_path_factory, header):
    out = tmp_path_factory.mktemp("fuzz-shard") / "out"
    shutil.copytree(ep2, out)
    rel = "rank-00000-of-00002/layers.0.safetensors"
    size = (out / rel).stat().st_size
    body = json.dumps(header).encode()
    raw = len(body).to_bytes(8, "little") + body
    (out / rel).write_bytes(raw + b"\0" * max(0, size - len(raw)))
    try:
        load_rank(out, 0)
    except MegamoeError as e:
        assert "\n" not in str(e)
        assert isinstance(e, HANDLED_ERRORS)
        return
    raise AssertionError("a damaged shard loaded")
