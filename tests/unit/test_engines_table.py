"""The serving table (``source/engines_table.py``): its rows name what the rest of the tree knows
(families, weight formats, the releases the engine tests run), and every place that says which
engine serves what says it from the table: the help, ``inspect`` of each family's conversion, the
README."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_cli
from engine_envs import ENGINES as ENGINE_ENVS

from megamoe_convert.layout.identity import PROVEN
from megamoe_convert.source import engines_table, families, formats
from megamoe_convert.synth import PRESETS

REPO = Path(__file__).resolve().parents[2]


def one_line(text: str) -> str:
    """Help text with its wrapping undone."""
    return " ".join(text.split())


def test_every_row_names_a_known_family_format_and_release():
    for row in engines_table.ROWS:
        engine = engines_table.engine(row.engine)
        assert set(row.releases) <= set(engine.releases), row
        for name in row.families:
            family = families.by_name(name)
            assert set(row.formats) & set(family.weight_formats), (row, name)
        assert set(row.formats) <= set(formats.FORMATS), row
        assert row.gpu in (engines_table.BLACKWELL, engines_table.HOPPER)


def test_the_tables_releases_are_those_the_engine_tests_run():
    """Each engine's releases are the ones ``tests/engines`` runs in their real code (``engine_envs``)
    and the layout probe records as proven (``0.30`` names ``0.30.0``)."""
    for engine in engines_table.ENGINES:
        tested = [spec.split("==")[1] for spec in ENGINE_ENVS if spec.startswith(f"{engine.name}==")]
        for versions in (tested, list(PROVEN[engine.name])):
            assert len(versions) == len(engine.releases), (engine.name, versions)
            assert all(v == r or v.startswith(f"{r}.") for v, r in zip(versions, engine.releases, strict=True))


def test_each_family_defaults_to_the_engine_that_serves_it():
    assert engines_table.default_engine(families.DEEPSEEK_V4) == "vllm"
    assert engines_table.default_engine(families.KIMI_K3) == "vllm"
    assert engines_table.default_engine(families.DEEPSEEK_V3) == "sglang"
    assert engines_table.default_engine(families.QWEN3_MOE) == "sglang"
    assert engines_table.default_engine(families.GLM4_MOE) is None
    assert "Glm4MoeSparseMoeBlock never takes the MegaMoE forward" in engines_table.unserved_note(families.GLM4_MOE)


@pytest.mark.parametrize("family,fmt,dims,vllm,sglang", [
    (families.DEEPSEEK_V4, "mxfp4", (7168, 2048), "vLLM 0.30-0.33 on Blackwell", "SGLang 0.5.23 on Blackwell"),
    (families.DEEPSEEK_V4, "mxfp4", (4096, 128), "vLLM 0.31-0.33 on Blackwell", "SGLang 0.5.23 on Blackwell"),
    (families.DEEPSEEK_V4, "nvfp4", (7168, 2048), "vLLM 0.33 on Blackwell", "SGLang"),
    (families.KIMI_K3, "mxfp4", (7168, 2048), "vLLM 0.33 on Blackwell", "SGLang"),
    (families.DEEPSEEK_V3, "fp8_block", (7168, 2048), "vLLM", "SGLang 0.5.23 on Hopper"),
])
def test_served_by_names_the_releases_and_gpus_of_the_rows_that_take_the_numbers(family, fmt, dims, vllm, sglang):
    """vLLM 0.30 pads I to a multiple of 512 (a layout no conversion holds), so I = 128 is 0.31 on;
    NVFP4 is 0.33's only; an engine that serves none is named alone."""
    assert engines_table.served_by("vllm", family, fmt, *dims) == vllm
    assert engines_table.served_by("sglang", family, fmt, *dims) == sglang


def test_the_help_states_the_whole_support_matrix():
    app = one_line(run_cli("-h").stdout)
    assert ("vLLM 0.30-0.33: DeepSeek-V4 (0.30-0.33), DeepSeek-V4.1 and Kimi-K3 (0.33) on Blackwell; SGLang 0.5.23: "
            "DeepSeek-V4 on Blackwell, DeepSeek-V3 and Qwen3-MoE on Hopper") in app
    convert = one_line(run_cli("convert", "-h").stdout)
    for family in families.FAMILIES:
        assert (family.title in convert) is bool(engines_table.engines_for(family)), family.title
    assert "sglang for DeepSeek-V3 and Qwen3-MoE" in convert
    synth = run_cli("synth", "-h").stdout
    assert all(re.search(rf"\b{re.escape(preset)}\b", synth) for preset in PRESETS)
    assert f"--format {'|'.join(formats.FORMATS)}" in synth
    assert "fp8_block (DeepSeek-V3, Qwen3-MoE, GLM-4.5)" in one_line(synth)


@pytest.mark.parametrize("preset,args", [("kimi-k3-tiny", ()), ("v4.1-tiny", ("--num-redundant-experts", 4))])
def test_inspect_of_a_conversion_only_vllm_033_serves_says_so(tmp_path, preset, args):
    run_cli("synth", tmp_path / "ckpt", "--preset", preset, "-q")
    run_cli("convert", tmp_path / "ckpt", tmp_path / "out", "--ep-size", 4, *args, "-q")
    info = json.loads(run_cli("inspect", tmp_path / "out", "--json").stdout)
    assert info["serve"]["vllm"]["notes"] == ["vLLM 0.33 on Blackwell; one process per GPU (EP over data parallel)"]
    assert not info["serve"]["sglang"]["servable"] and info["serve"]["sglang"]["reason"].startswith("SGLang's ")
    served = run_cli("inspect", tmp_path / "out").stdout.split("serve with vllm:")[1]
    assert "vLLM 0.33 on Blackwell" in served and "0.30" not in served


def test_the_readme_states_what_the_table_serves():
    """Each row of the README's "Does it fit you?" table: its GPUs, engine and releases, and families
    (the DeepSeek-V3 family's title there is DeepSeek-V3/R1)."""
    text = (REPO / "README.md").read_text()
    fit = text.split("## Does it fit you?")[1].split("\n## ")[0]
    rows = [line for line in fit.splitlines() if line.startswith("| ") and "---" not in line]
    for row in engines_table.ROWS:
        engine = engines_table.engine(row.engine)
        on_gpu = [c for c in engines_table.rows(row.engine) if c.gpu == row.gpu]
        releases = engines_table.release_range(engine, [r for r in engine.releases
                                                        if any(r in c.releases for c in on_gpu)])
        matching = [line for line in rows if line.startswith(f"| {row.gpu}") and f"{engine.title} {releases}" in line]
        assert matching, (row, releases)
        assert all(families.by_name(f).title in matching[0] for f in row.families), (row, matching[0])
