"""What ``convert`` writes into ``OUT/config.json`` (the marker every load format relies on), and what
``verify`` checks of it, through the real CLI on real files."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import run_cli

from megamoe_convert import load_rank
from megamoe_convert.errors import LoadError
from megamoe_convert.output import marker


def test_convert_writes_the_marker_and_nothing_else_changes(tiny_ckpt, tiny_converted):
    source = json.loads((tiny_ckpt / "config.json").read_bytes())
    written = (tiny_converted / "config.json").read_bytes()
    config = json.loads(written)
    assert written == marker.mark((tiny_ckpt / "config.json").read_bytes())
    assert config["architectures"] == [f"MegaMoE-converted {a}: install megamoe-convert into this serving environment"
                                       for a in source["architectures"]]
    assert config["model_type"] == \
        f"MegaMoE-converted {source['model_type']}: install megamoe-convert into this serving environment"
    assert config["megamoe"] == {"converted_by": "megamoe-convert", "serve": marker.INSTALL,
                                 "architectures": source["architectures"], "model_type": source["model_type"]}
    assert list(config) == list(source) + ["megamoe"]  # every key where the source has it
    assert marker.original(config) == source  # every other key, unchanged
    restored = marker.restore_model_type(config)  # what transformers reads with the plugin
    assert restored["model_type"] == source["model_type"] and restored["architectures"] == config["architectures"]
    for name in ("tokenizer_config.json",):  # other small files: verbatim
        assert (tiny_converted / name).read_bytes() == (tiny_ckpt / name).read_bytes()
    manifest = json.loads((tiny_converted / "manifest.json").read_bytes())
    (record,) = [f for f in manifest["files"] if f["path"] == "config.json"]
    assert record["size"] == len(written)  # the manifest records the marked file


def test_verify_checks_the_marker_and_the_small_files_against_the_source(tiny_ckpt, tiny_converted, tmp_path):
    proc = run_cli("verify", tiny_converted, "--source", tiny_ckpt, "--json")
    report = json.loads(proc.stdout)
    assert report["ok"] and report["checks"]["marker"] == 1 and report["checks"]["small_files_vs_source"] == 2
    out = tmp_path / "unmarked"
    shutil.copytree(tiny_converted, out)
    shutil.copy(tiny_ckpt / "config.json", out / "config.json")  # its marker lost
    proc = run_cli("verify", out, "--source", tiny_ckpt, check=False)
    assert proc.returncode != 0
    assert "config.json: has no megamoe marker" in proc.stdout and "rerun the same convert command" in proc.stdout
    assert "config.json: differs from the source marked by megamoe-convert" in proc.stdout


def test_the_marker_moves_auto_map_so_no_remote_code_stands_in(tmp_path, tiny_ckpt):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    config = json.loads((src / "config.json").read_bytes())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV4ForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    run_cli("convert", src, out, "--ep-size", 2)
    marked = json.loads((out / "config.json").read_bytes())
    assert "auto_map" not in marked and marked["megamoe"]["auto_map"] == config["auto_map"]
    assert marker.original(marked) == config
    run_cli("verify", out, "--source", src)


def test_a_source_without_model_type_gets_a_marker_model_type_that_original_removes(tmp_path, tiny_ckpt):
    """DeepSeek-V4's flat config may have no ``model_type``: the marker adds one (a bare engine's
    ``AutoConfig`` refuses it all the same) and records that there was none."""
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    config = json.loads((src / "config.json").read_bytes())
    del config["model_type"]
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    run_cli("convert", src, out, "--ep-size", 2)
    marked = json.loads((out / "config.json").read_bytes())
    assert list(marked)[:2] == ["architectures", "model_type"] and marked["megamoe"]["model_type"] is None
    assert marked["model_type"] == "MegaMoE-converted checkpoint: install megamoe-convert into this serving environment"
    assert marker.original(marked) == config and "model_type" not in marker.restore_model_type(marked)
    run_cli("verify", out, "--source", src)


def test_mark_refuses_a_model_type_that_is_no_name():
    """(``convert`` refuses such a source earlier, by its family.)"""
    with pytest.raises(marker.MarkerError, match=r"src/config.json: 'model_type' must be a name, found \['x'\]"):
        marker.mark(json.dumps({"architectures": ["X"], "model_type": ["x"]}).encode(), "src/config.json")


def test_verify_reports_a_section_that_names_no_original_model_type(tiny_converted, tmp_path):
    """Without it the source's ``config.json`` cannot be given back: ``verify`` lists the marker as
    broken and the loader refuses the directory."""
    out = tmp_path / "edited"
    shutil.copytree(tiny_converted, out)
    config = json.loads((out / "config.json").read_bytes())
    del config["megamoe"]["model_type"]
    (out / "config.json").write_text(json.dumps(config))
    proc = run_cli("verify", out, check=False)
    assert proc.returncode != 0 and "the 'megamoe' section names no original model_type" in proc.stdout
    with pytest.raises(LoadError, match="the 'megamoe' section names no original model_type"):
        load_rank(out, 0)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("architectures"), "'architectures' must be a non-empty list of names, found None"),
    (lambda c: c.update(megamoe={"converted_by": "megamoe-convert"}),
     "a megamoe-convert output's config.json, not a source checkpoint's"),
])
def test_convert_refuses_a_config_it_cannot_mark_in_one_line(tmp_path, tiny_ckpt, change, message):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    config = json.loads((src / "config.json").read_bytes())
    change(config)
    (src / "config.json").write_text(json.dumps(config))
    proc = run_cli("convert", src, tmp_path / "out", "--ep-size", 2, check=False)
    assert proc.returncode != 0 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
