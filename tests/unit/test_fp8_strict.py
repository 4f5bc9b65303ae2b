"""FP8 block-scaled checkpoints (DeepSeek-V3, Qwen3-MoE) are checked as strictly as the other formats:
a NaN or infinite ``weight_scale_inv`` and a ``quantization_config`` that is not the one their experts
are (128x128 e4m3 blocks) are refused in one line naming the tensor or the key, on real files."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from conftest import run_cli

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.errors import CheckpointError, FormatError
from megamoe_convert.source import formats
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.synth.write import synthesize
from megamoe_convert.verify import verify

#: The qwen3-moe-tiny preset's routed expert 2 of layer 1, its up projection's FP32 block scales.
SCALE = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
RELEASE_SECTION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE FP8 checkpoint as the release ships it (the preset's quantization_config). Read-only."""
    path = tmp_path_factory.mktemp("fp8") / "qwen3"
    synthesize(path, "qwen3-moe-tiny", seed=4)
    return path


def copy_of(src: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    return copy


def poison(src: Path, name: str, block: int, value: float) -> None:
    """Overwrite one FP32 block scale of tensor ``name`` in place (the file keeps its size)."""
    entry = Checkpoint.open(src).tensors[name]
    assert entry.dtype == "F32"
    with open(entry.path, "r+b") as f:
        f.seek(entry.begin + 4 * block)
        f.write(struct.pack("<f", value))


def edit_quantization(src: Path, section: object) -> None:
    config = json.loads((src / "config.json").read_text())
    if section is None:
        config.pop("quantization_config")
    else:
        config["quantization_config"] = section
    (src / "config.json").write_text(json.dumps(config))


def test_the_presets_write_the_section_their_experts_need():
    for preset in ("deepseek-v3-tiny", "qwen3-moe-tiny", "glm-4.5-tiny", "deepseek-v3", "qwen3-moe", "glm-4.5"):
        config = json.loads((Path(__file__).resolve().parents[2] / "configs" / f"{preset}.json").read_text())
        assert config["quantization_config"] == formats.quantization_config(formats.FP8_BLOCK) == RELEASE_SECTION


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_block_scale_is_refused_in_one_line_before_anything_is_written(fp8_ckpt, tmp_path, value):
    src = copy_of(fp8_ckpt, tmp_path)
    poison(src, SCALE, 3, value)
    out = tmp_path / "out"
    proc = run_cli("convert", src, out, "--ep-size", 2, "--engine", "sglang", check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert f"{SCALE} is {value} at block [0, 3]" in lines[0] and "must be finite" in lines[0]
    assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.rglob("*"))


def test_a_finite_source_converts_and_zero_scales_pass(fp8_ckpt, tmp_path):
    """An all-zero block has scale 0 (amax / 448): a real value, kept."""
    src = copy_of(fp8_ckpt, tmp_path)
    poison(src, SCALE, 0, 0.0)
    convert(src, tmp_path / "out", ConvertOptions(ep_size=None, fsync=False))
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_verify_reports_a_non_finite_scale_its_conversion_copied(fp8_ckpt, tmp_path, monkeypatch):
    """A conversion holding the NaN (made without the check) equals its source byte for byte and in
    numerics; verify --source still names the scale."""
    src = copy_of(fp8_ckpt, tmp_path)
    poison(src, SCALE, 1, float("nan"))
    with monkeypatch.context() as patch:
        patch.setattr(Checkpoint, "check_block_scales", lambda *args: None)
        convert(src, tmp_path / "out", ConvertOptions(ep_size=None, fsync=False))
    report = verify(tmp_path / "out", source=src, numerics=True)
    assert not report.ok
    assert [str(p) for p in report.problems if SCALE in str(p) and "is nan at block [0, 1]" in str(p)], report.problems


def test_only_the_checked_layers_scales_are_read(fp8_ckpt, tmp_path):
    """--layers: the scan covers what is converted (a NaN elsewhere is another run's to refuse)."""
    src = copy_of(fp8_ckpt, tmp_path)
    poison(src, SCALE, 0, float("nan"))
    convert(src, tmp_path / "layer0", ConvertOptions(ep_size=None, layers="0", fsync=False))
    with pytest.raises(CheckpointError, match=f"{SCALE} is nan"):
        convert(src, tmp_path / "layer1", ConvertOptions(ep_size=None, layers="1", fsync=False))


@pytest.mark.parametrize("section, message", [
    (None, "quantization_config is missing; fp8_block experts need "),
    ("fp8", "quantization_config is 'fp8'; fp8_block experts need "),
    ({**RELEASE_SECTION, "weight_block_size": [64, 64]},
     r"quantization_config.weight_block_size is [64, 64], expected [128, 128]"),
    ({**RELEASE_SECTION, "weight_block_size": [128, 128.5]}, "quantization_config.weight_block_size is [128, 128.5]"),
    ({k: v for k, v in RELEASE_SECTION.items() if k != "weight_block_size"},
     "quantization_config.weight_block_size is missing, expected [128, 128]"),
    ({**RELEASE_SECTION, "fmt": "e5m2"}, "quantization_config.fmt is 'e5m2', expected \"e4m3\""),
    ({**RELEASE_SECTION, "quant_method": "compressed-tensors"},
     "quantization_config.quant_method is 'compressed-tensors', expected \"fp8\""),
    ({**RELEASE_SECTION, "activation_scheme": "static"},
     "quantization_config.activation_scheme is 'static', expected \"dynamic\""),
])
def test_a_quantization_config_other_than_the_experts_is_refused_by_key(fp8_ckpt, tmp_path, section, message):
    src = copy_of(fp8_ckpt, tmp_path)
    edit_quantization(src, section)
    with pytest.raises(FormatError) as refused:
        Checkpoint.open(src)
    assert str(refused.value).startswith(f"{src / 'config.json'}: ") and message in str(refused.value)


def test_a_quantization_config_refusal_is_one_line_from_the_cli(fp8_ckpt, tmp_path):
    src = copy_of(fp8_ckpt, tmp_path)
    edit_quantization(src, {**RELEASE_SECTION, "weight_block_size": [64, 64]})
    proc = run_cli("convert", src, tmp_path / "out", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "quantization_config.weight_block_size is [64, 64], expected [128, 128]" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("left_out", ["fmt", "activation_scheme"])
def test_keys_whose_absence_means_the_release_value_may_be_left_out(fp8_ckpt, tmp_path, left_out):
    src = copy_of(fp8_ckpt, tmp_path)
    edit_quantization(src, {k: v for k, v in RELEASE_SECTION.items() if k != left_out})
    assert Checkpoint.open(src).dims.weight_format == "fp8_block"


def test_other_formats_quantization_config_is_not_theirs_to_check(tiny_ckpt, tmp_path):
    """DeepSeek-V4.1's quantization_config describes its FP8 non-expert linears (32x32 blocks), not
    its FP4 experts: a V4 checkpoint carrying one opens as before."""
    src = copy_of(tiny_ckpt, tmp_path)
    edit_quantization(src, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"})
    assert Checkpoint.open(src).dims.weight_format == "mxfp4"
