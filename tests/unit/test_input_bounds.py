"""Inputs the tool bounds and parses strictly: one parser for numbers, unreadable files refused in
one line (verify goes on), documents and plans bounded before they are read or written, and synth's
counts and formats. Real files, real CLI subprocesses (`run_cli`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import run_cli
from damage import EP2, RANK0, copy, one_line_refusal, problems

from megamoe_convert import load_rank
from megamoe_convert.errors import LoadError, MegamoeError
from megamoe_convert.source.layers import MoELayer


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "tiny"
    run_cli("synth", path)
    return path


@pytest.fixture(scope="module")
def ep2(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ep2") / "out"
    run_cli("convert", src, out, *EP2)
    return out


def with_config(src: Path, tmp_path: Path, name: str = "src", **fields) -> Path:
    """A copy of ``src`` whose config.json (text config for families that nest it) has ``fields``."""
    new = copy(src, tmp_path, name)
    config = json.loads((new / "config.json").read_text())
    (config.get("text_config") or config).update(fields)
    (new / "config.json").write_text(json.dumps(config))
    return new


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("field, value", [("routed_scaling_factor", "2.5"), ("routed_scaling_factor", [1.5]),
                                          ("routed_scaling_factor", True), ("swiglu_limit", "10"),
                                          ("swiglu_limit", {"x": 1}), ("swiglu_limit", -1)])
def test_config_numbers_of_the_wrong_type_are_one_line(src, ep2, tmp_path, field, value):
    bad = with_config(src, tmp_path, **{field: value})
    proc = run_cli("verify", ep2, "--source", bad, "--numerics", check=False)
    one_line_refusal(proc, "config.json", field, "source checkpoint")


def test_kimi_situ_betas_of_the_wrong_type_are_one_line(tmp_path):
    kimi = tmp_path / "kimi"
    run_cli("synth", kimi, "--preset", "kimi-k3-tiny")
    run_cli("convert", kimi, tmp_path / "out", *EP2)
    for field, value in (("activation_situ_beta", "1"), ("activation_situ_linear_beta", [2.0])):
        bad = with_config(kimi, tmp_path, f"bad-{field}", **{field: value})
        proc = run_cli("verify", tmp_path / "out", "--source", bad, "--numerics", check=False)
        one_line_refusal(proc, field, "must be a number")


@pytest.mark.parametrize("spec", ["²", "٣", "1-²", "0-١", "+1", "1_0", "0x1"])
def test_unicode_and_odd_digits_are_refused_in_one_line(src, ep2, tmp_path, spec):
    one_line_refusal(run_cli("convert", src, tmp_path / "o", "--ep-size", 2, "--ranks", spec, check=False),
                     "--ranks: cannot parse")
    one_line_refusal(run_cli("verify", ep2, "--ranks", spec, check=False), "--ranks: cannot parse")
    if not spec.startswith("+"):
        one_line_refusal(run_cli("convert", src, tmp_path / "o", "--ep-size", 2, "--layers", spec, check=False),
                         "--layers")
    one_line_refusal(run_cli("convert", src, tmp_path / "o", "--ep-size", 2, "--shard", f"{spec}/2", check=False),
                     "--shard")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_a_layer_key_with_other_digits_is_no_layer_key():
    """Layer numbers are ASCII and canonical: one tensor, one name (``layers.1٣`` is not ``layers.13``)."""
    for key in ("layers.1٣", "layers.٣", "mtp.01", "layers.+1", "layers.1_0"):
        with pytest.raises(ValueError, match="not a layer key"):
            MoELayer.parse(key)
    assert MoELayer.parse("layers.13") == MoELayer(False, 13) and MoELayer.parse("mtp.0") == MoELayer(True, 0)


# ----------------------------------------------------------------------------- unreadable files


def test_a_directory_in_place_of_a_rank_file_is_listed_and_verify_goes_on(ep2, src, tmp_path):
    out = copy(ep2, tmp_path)
    path = out / RANK0 / "layers.1.safetensors"
    path.unlink()
    path.mkdir()
    with pytest.raises(LoadError, match="not a regular file"):
        load_rank(out, 0, verify=True)
    proc = run_cli("verify", out, "--source", src, check=False)
    assert proc.returncode == 1 and f"{RANK0}/layers.1.safetensors: not a regular file (listed in manifest.json " \
                                   "as one)" in problems(proc)
    assert "expert slots vs source" in proc.stdout  # it went on past the bad file


def test_an_unreadable_journal_fails_the_rerun_before_the_manifest_goes(ep2, src, tmp_path):
    out = copy(ep2, tmp_path)
    journal = out / ".megamoe" / "journal.jsonl"
    journal.unlink()
    journal.mkdir()  # reads of it fail, as root too
    for extra in ((), ("--overwrite",)):
        one_line_refusal(run_cli("convert", src, out, *EP2, *extra, check=False), "journal.jsonl",
                         "nothing was changed")
        assert (out / "manifest.json").exists()
    assert run_cli("verify", out).returncode == 0


# ----------------------------------------------------------------------------- bounded documents


def test_an_oversized_placement_file_is_refused_before_it_is_parsed(src, tmp_path):
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"physical_to_logical": list(range(8)), "junk": "x" * (17 << 20)}))
    started = time.monotonic()
    one_line_refusal(run_cli("convert", src, tmp_path / "o", "--ep-size", 2, "--placement", placement, check=False),
                     "placement file is", "more than one can hold")
    assert time.monotonic() - started < 60
    placement.write_text(json.dumps({"physical_to_logical": list(range(8)), "junk": 1}))
    one_line_refusal(run_cli("convert", src, tmp_path / "o", "--ep-size", 2, "--placement", placement, check=False),
                     "unknown field 'junk'")


def test_an_oversized_manifest_is_refused_by_its_size(ep2, tmp_path):
    out = copy(ep2, tmp_path)
    os.truncate(out / "manifest.json", 129 << 20)  # sparse: no 129 MB written
    with pytest.raises(MegamoeError, match="more than one can hold"):
        load_rank(out, 0)
    assert any("more than one can hold" in p for p in problems(run_cli("verify", out, check=False)))


# ----------------------------------------------------------------------------- plans


@pytest.mark.parametrize("args, needle", [(("--layers", 70000), "--layers 70000"),
                                          (("--mtp-layers", 70000), "--mtp-layers 70000"),
                                          (("--experts", 300000), "--experts 300000"),
                                          (("--layers", 3000, "--experts", 100), "routed experts")])
def test_synth_counts_are_bounded(tmp_path, args, needle):
    one_line_refusal(run_cli("synth", tmp_path / "ckpt", *args, check=False), needle)
    assert list(tmp_path.iterdir()) == []


def test_synth_failing_midway_removes_its_temporary_folder(tmp_path):
    proc = run_cli("synth", tmp_path / "ckpt", check=False, env={"MEGAMOE_TEST_FAULTS": "enospc-after-bytes=300000"})
    last = proc.stderr.strip().splitlines()[-1]  # after its progress lines
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert last.startswith("error: ") and "No space left on device" in last
    assert list(tmp_path.iterdir()) == []


def test_convert_checks_its_plan_against_free_space_first(src, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("convert", src, out, "--ep-size", 65536, "--num-redundant-experts", 1048568, check=False,
                   env={"MEGAMOE_TEST_FAULTS": "free-bytes=50000000000"}, timeout=600)  # a 50 GB disk
    one_line_refusal(proc, "this conversion needs", "GB of disk space but only 50.0 GB is free",
                     "nothing was written")
    assert not list(out.glob("rank-*")) and not (out / "manifest.json").exists()
    proc = run_cli("convert", src, out, *EP2, check=False, env={"MEGAMOE_TEST_FAULTS": "free-bytes=1000000"})
    one_line_refusal(proc, "3.2 MB of disk space but only 1.0 MB is free")
    run_cli("convert", src, out, *EP2)  # room again: it converts


def test_synth_of_a_full_size_preset_checks_free_space_first(tmp_path):
    one_line_refusal(run_cli("synth", tmp_path / "flash", "--preset", "flash", check=False,
                             env={"MEGAMOE_TEST_FAULTS": "free-bytes=100000000000"}),
                     "this flash checkpoint needs 154.4 GB", "only 100.0 GB is free")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "bf16"])
def test_synth_refuses_a_format_the_family_does_not_ship(tmp_path, fmt):
    one_line_refusal(run_cli("synth", tmp_path / "k", "--preset", "kimi-k3-tiny", "--format", fmt, check=False),
                     f"--format {fmt}", "Kimi-K3 checkpoints ship mxfp4")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- placement files and parts


def test_placement_files_fields_are_never_ignored(src, tmp_path):
    out = tmp_path / "o"
    wrong_default = tmp_path / "default.json"
    wrong_default.write_text(json.dumps({"physical_to_logical": [1, 0, 2, 3, 4, 5, 6, 7], "default": True}))
    one_line_refusal(run_cli("convert", src, out, "--ep-size", 2, "--placement", wrong_default, check=False),
                     "default is True, but its physical_to_logical gives False")
    # `plan --json` output is a placement file: its per-layer placements must be what the engine builds.
    planned = run_cli("plan", src, "--ep-size", 2, "--num-redundant-experts", 2, "--engine", "sglang", "--json").stdout
    data = json.loads(planned)
    assert data["layer_placements"]  # SGLang builds the MTP layer without redundant experts
    (tmp_path / "plan.json").write_text(planned)
    run_cli("convert", src, out, *EP2, "--engine", "sglang", "--placement", tmp_path / "plan.json")
    one_line_refusal(run_cli("convert", src, tmp_path / "o2", *EP2, "--placement", tmp_path / "plan.json",
                             check=False), "planned for engine 'sglang'")
    mtp = data["layer_placements"]["mtp.0"]
    mtp["physical_to_logical"], mtp["default"] = mtp["physical_to_logical"][::-1], False
    (tmp_path / "edited.json").write_text(json.dumps(data))
    one_line_refusal(run_cli("convert", src, tmp_path / "o3", *EP2, "--engine", "sglang", "--placement",
                             tmp_path / "edited.json", check=False), "layer_placements.mtp.0 is not the placement")


def test_parts_converted_from_two_sources_are_refused_at_merge(src, tmp_path):
    other = tmp_path / "other"
    run_cli("synth", other, "--seed", 7)  # the same structure, other bytes
    for i, source in enumerate((src, other)):
        run_cli("convert", source, tmp_path / f"p{i}", *EP2, "--shard", f"{i}/2")
    one_line_refusal(run_cli("merge", tmp_path / "out", tmp_path / "p0", tmp_path / "p1", check=False),
                     "were converted from different sources", "holds other bytes")
    assert not (tmp_path / "out" / "manifest.json").exists()
    run_cli("convert", src, tmp_path / "p1b", *EP2, "--shard", "1/2")
    run_cli("merge", tmp_path / "out", tmp_path / "p0", tmp_path / "p1b")
    assert run_cli("verify", tmp_path / "out", "--source", src).returncode == 0
