"""`verify --source` compares every tensor a kernel reads (NVFP4 scales, the fused shared expert)
and the model family, and a source's non-finite scales are its own problem: real files, real CLI
subprocesses (`run_cli`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from damage import EP2, RANK0, copy, f32, one_line_refusal, poke, problems, reseal

from megamoe_convert import load_rank
from megamoe_convert.errors import LoadError
from megamoe_convert.output.compare import same_values
from megamoe_convert.source.safetensors_io import read_header


@pytest.mark.parametrize("tensor, numerics", [
    ("l2.input_scale", True), ("l2.input_scale_all", True),  # the kernel quantises L2 inputs with them
    ("l1.global_scale", False), ("l2.global_scale", False),  # NVFP4 global scales without --numerics
])
def test_nvfp4_scales_changed_and_resealed_fail_verify_source(converted, sources, tmp_path, tensor, numerics):
    out = copy(converted["nv"], tmp_path)
    rank_file = out / RANK0 / "layers.0.safetensors"
    poke(rank_file, f"layers.0.ffn.experts.{tensor}", f32(7.0))
    reseal(out)
    assert run_cli("verify", out).returncode == 0  # intact as far as the manifest can tell
    proc = run_cli("verify", out, "--source", sources["nv"], *(["--numerics"] if numerics else []), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert problems(proc) == [f"rank 0 layers.0: {tensor} differs from the source"]


@pytest.mark.parametrize("tensor", ["shared_l1.weight", "shared_l1.sf", "shared_l2.weight", "shared_l2.sf"])
def test_a_zeroed_fused_shared_expert_fails_verify_source(converted, sources, tmp_path, tensor):
    out = copy(converted["mx"], tmp_path)
    path = out / "rank-00001-of-00002" / "mtp.0.safetensors"
    entry = read_header(path).tensors[f"mtp.0.ffn.experts.{tensor}"]
    poke(path, entry.name, bytes(entry.nbytes))
    reseal(out)
    proc = run_cli("verify", out, "--source", sources["mx"], check=False)
    assert proc.returncode == 1 and problems(proc) == [f"rank 1 mtp.0: {tensor} differs from the source"]
    assert "extra tensors vs source" in proc.stdout


def test_verify_source_passes_an_untouched_conversion_and_counts_every_extra_tensor(converted, sources):
    for name in ("mx", "nv", "v41"):
        proc = run_cli("verify", converted[name], "--source", sources[name], "--numerics", "--json")
        report = json.loads(proc.stdout)
        assert report["ok"] and report["checks"]["extra_tensors_vs_source"] > 0, report


def test_a_relabelled_family_fails_verify_and_load_rank(converted, sources, tmp_path):
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
@pytest.mark.parametrize("tensor", ["layers.0.ffn.experts.2.w1.weight_scale_2",
                                    "layers.0.ffn.experts.3.w2.input_scale"])
def test_a_non_finite_or_non_positive_global_scale_is_a_source_problem(sources, tmp_path, value, tensor):
    src = _nvfp4_source_with(sources, tmp_path, tensor, value)
    if tensor.endswith("w1.weight_scale_2"):  # w3's must stay equal to w1's, or that is the refusal
        weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        poke(src / weight_map[tensor.replace("w1", "w3")], tensor.replace("w1", "w3"), f32(value))
    proc = run_cli("convert", src, tmp_path / "out", *EP2, check=False)
    one_line_refusal(proc, tensor, "finite and positive", "source checkpoint")
    assert not (tmp_path / "out" / "manifest.json").exists() and not list((tmp_path / "out").glob("rank-*"))


def test_numerics_gives_no_false_verdict_on_nan_and_refuses_an_absurd_scaling_factor(converted, sources,
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
