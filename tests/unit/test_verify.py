"""`megamoe verify`: passes on a fresh conversion, names precisely what is wrong otherwise."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import run_cli

from megamoe_convert import verify as verify_module
from megamoe_convert.errors import UsageError
from megamoe_convert.layout import scales, transform
from megamoe_convert.output.seal import seal
from megamoe_convert.source.layers import MoELayer
from megamoe_convert.source.safetensors_io import read_header
from megamoe_convert.verify import deep_gemm as verify_deep_gemm
from megamoe_convert.verify import numerics as verify_numerics
from megamoe_convert.verify import verify


@pytest.fixture
def damaged(tiny_converted, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(tiny_converted, out)
    return out


def rewrite_manifest_record(out: Path, rel: str) -> None:
    """Make the manifest agree with a tampered file, so only deeper checks can catch it."""
    manifest = json.loads((out / "manifest.json").read_text())
    data = (out / rel).read_bytes()
    for record in manifest["files"]:
        if record["path"] == rel:
            record["size"], record["checksum"] = len(data), xxhash.xxh3_128_hexdigest(data)
    (out / "manifest.json").write_text(seal(manifest))


def problems(out: Path, *args: object) -> tuple[int, list[str]]:
    proc = run_cli("verify", out, "--json", *args, check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["ok"] else 1), proc.stderr
    return proc.returncode, report["problems"]


def test_fresh_conversion_passes_every_level(tiny_ckpt, tiny_converted):
    proc = run_cli("verify", tiny_converted, "--source", tiny_ckpt, "--numerics", "--deep-gemm", "--json")
    report = json.loads(proc.stdout)
    assert report["ok"] and report["problems"] == []
    assert report["checks"]["files"] == len(json.loads((tiny_converted / "manifest.json").read_text())["files"])
    assert report["checks"]["rank_shards"] == 12 and report["checks"]["expert_slots_vs_source"] == 36
    assert report["checks"]["non_expert_tensors_vs_source"] > 10
    assert report["numerics"]["max_abs_err"] == 0.0 and report["numerics"]["layers"] == 4  # 3 layers, 4 ranks in turn
    assert report["numerics"]["swiglu_limit"] == 10.0
    assert "deep_gemm" in report["skipped"]
    table = run_cli("verify", tiny_converted).stdout
    assert "OK" in table and "rank shards" in table


def test_flipped_byte_is_caught_by_its_checksum(damaged):
    path = damaged / "rank-00001-of-00004" / "layers.0.safetensors"
    data = bytearray(path.read_bytes())
    data[-200] ^= 0x10
    path.write_bytes(bytes(data))
    code, found = problems(damaged)
    assert code == 1 and found == ["rank-00001-of-00004/layers.0.safetensors: checksum mismatch with manifest.json "
                                   "(file is corrupted or was modified)"]


def test_edited_index_and_unlisted_weight_files_are_reported(damaged):
    """The index is listed with its checksum like any other file; weight files the manifest does
    not list are flagged (a reader globbing for shards would take them); the user's notes are not."""
    index_path = damaged / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "model-00099-of-00099.safetensors"
    index_path.write_text(json.dumps(index, indent=2))
    shutil.copy(damaged / "rank-00001-of-00004" / "layers.0.safetensors",
                damaged / "rank-00001-of-00004" / "layers.99.safetensors")
    (damaged / "model-00099-of-00099.safetensors").write_bytes(b"stray")
    (damaged / "NOTES.md").write_text("mine")
    code, found = problems(damaged)
    assert code == 1
    assert {p.split(":")[0] for p in found} == {"model.safetensors.index.json", "model-00099-of-00099.safetensors",
                                                 "rank-00001-of-00004/layers.99.safetensors"}


def test_missing_and_truncated_files_are_listed(damaged, tiny_ckpt):
    (damaged / "rank-00002-of-00004" / "mtp.0.safetensors").unlink()
    shard = damaged / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    code, found = problems(damaged, "--source", tiny_ckpt)
    assert code == 1
    assert "rank-00002-of-00004/mtp.0.safetensors: missing (listed in manifest.json)" in found
    assert any(p.startswith("model-00001-of-00001.safetensors: size") for p in found)
    assert any(p.startswith("rank 2 mtp.0: cannot be loaded") for p in found)


def test_swapped_experts_are_caught_against_the_source(damaged, tiny_ckpt):
    rel = "rank-00003-of-00004/layers.1.safetensors"
    path = damaged / rel
    entry = read_header(path).tensors["layers.1.ffn.experts.l2.weight"]
    per_expert = entry.nbytes // entry.shape[0]
    data = bytearray(path.read_bytes())
    a, b = entry.begin, entry.begin + per_expert
    data[a:a + per_expert], data[b:b + per_expert] = data[b:b + per_expert], data[a:a + per_expert]
    path.write_bytes(bytes(data))
    rewrite_manifest_record(damaged, rel)
    assert problems(damaged) == (0, [])  # integrity alone cannot see it ...
    code, found = problems(damaged, "--source", tiny_ckpt)  # ... the source can
    assert code == 1 and found == [
        "rank 3 layers.1 slot 0: l2.weight differs from logical expert 1 of the source",
        "rank 3 layers.1 slot 1: l2.weight differs from logical expert 2 of the source"]


def test_changed_non_expert_tensor_is_caught_against_the_source(damaged, tiny_ckpt):
    index = json.loads((damaged / "model.safetensors.index.json").read_text())
    rel = index["weight_map"]["norm.weight"]
    entry = read_header(damaged / rel).tensors["norm.weight"]
    data = bytearray((damaged / rel).read_bytes())
    data[entry.begin] ^= 0x01
    (damaged / rel).write_bytes(bytes(data))
    rewrite_manifest_record(damaged, rel)
    assert problems(damaged) == (0, [])
    code, found = problems(damaged, "--source", tiny_ckpt)
    assert code == 1 and len(found) == 1 and found[0].startswith("norm.weight: differs from the source")


def test_wrong_placement_in_the_manifest_is_caught(damaged):
    manifest = json.loads((damaged / "manifest.json").read_text())
    p = manifest["placement"]["physical_to_logical"]
    p[0], p[5] = p[5], p[0]
    manifest["placement"]["default"] = False
    (damaged / "manifest.json").write_text(seal(manifest))
    code, found = problems(damaged)
    assert code == 1
    assert found == [f"rank-0000{r}-of-00004/{layer}.safetensors: holds logical experts {held}, but manifest.json's "
                     f"placement gives this rank {want}"
                     for r, held, want in ((0, [0, 1, 2], [5, 1, 2]), (1, [3, 4, 5], [3, 4, 0]))
                     for layer in ("layers.0", "layers.1", "mtp.0")]


def test_sample_and_ranks_limit_the_work(tiny_converted, tiny_ckpt):
    report = json.loads(run_cli("verify", tiny_converted, "--source", tiny_ckpt, "--sample", 5, "--ranks", "1-2",
                                "--json").stdout)
    assert report["ok"] and report["checks"]["expert_slots_vs_source"] == 5
    assert report["checks"]["rank_shards"] == 6


def test_usage_errors_exit_2(tiny_converted):
    proc = run_cli("verify", tiny_converted, "--ranks", "7", check=False)
    assert proc.returncode == 2 and "outside 0..3" in proc.stderr
    proc = run_cli("verify", tiny_converted, "--device", "tpu", check=False)
    assert proc.returncode == 2 and "'tpu' is not one of" in proc.stderr
    missing = tiny_converted.parent / "no-such-dir"
    proc = run_cli("verify", missing, check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {missing}: no such directory"


@pytest.mark.parametrize("flag", [("--numerics",), ("--deep-gemm",), ("--sample", "3")])
def test_checks_against_the_source_without_source_fail_rather_than_pass(tiny_converted, flag):
    """A check that was asked for and could not run must not read as OK."""
    proc = run_cli("verify", tiny_converted, *flag, check=False)
    assert proc.returncode == 2 and "pass --source" in proc.stderr and "OK" not in proc.stdout
    with pytest.raises(UsageError, match="pass --source"):
        verify(tiny_converted, numerics=flag[0] == "--numerics", deep_gemm=flag[0] == "--deep-gemm",
               sample=3 if flag[0] == "--sample" else None)


def test_numerics_on_cuda_without_a_gpu_is_one_clear_line(tiny_converted, tiny_ckpt):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli("verify", tiny_converted, "--source", tiny_ckpt, "--numerics", "--device", "cuda", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("error: --device: device 'cuda': no CUDA GPU is available to this process; "
                                   "leave out --device to run on the CPU (the default)")


def test_numerics_run_every_layer_once_and_every_rank_by_default():
    """Each layer once, the ranks in turn, every rank at least once; every rank x layer when asked."""
    layers = [MoELayer.parse(k) for k in ("layers.0", "layers.1", "layers.2", "mtp.0")]
    for ranks in ([0], [0, 1, 2, 3, 4, 5, 6, 7], [3, 5]):
        checks = verify_module.numerics_checks(ranks, layers)
        assert {layer for _, layer in checks} == set(layers) and {r for r, _ in checks} == set(ranks)
        assert len(checks) == len(set(checks)) == max(len(ranks), len(layers))
    assert len(verify_module.numerics_checks([0, 1], layers, every_rank=True)) == 8


def test_numerics_run_a_ranks_edge_slots():
    """The first and last local slot of a rank, then random ones up to the bound."""
    g = torch.Generator().manual_seed(0)
    assert verify_numerics.numerics_slots(3, 2, g) == [0, 2] and verify_numerics.numerics_slots(1, 2, g) == [0]
    slots = verify_numerics.numerics_slots(10, 4, g)
    assert len(slots) == 4 == len(set(slots)) and slots[0] == 0 and slots[-1] == 9


def test_numerics_every_rank_checks_each_rank_and_layer(tiny_converted, tiny_ckpt):
    proc = run_cli("verify", tiny_converted, "--source", tiny_ckpt, "--numerics", "--numerics-every-rank", "--json")
    assert json.loads(proc.stdout)["numerics"]["layers"] == 12
    assert "numerics: 12 checks (every rank x layer)" in proc.stderr


def test_numerics_detect_a_wrong_scale(damaged, tiny_ckpt):
    """One UE8M0 scale byte changed (and the checksum forged): bytes and numerics both disagree."""
    rel = "rank-00000-of-00004/layers.0.safetensors"
    path = damaged / rel
    entry = read_header(path).tensors["layers.0.ffn.experts.l2.sf"]
    data = bytearray(path.read_bytes())
    data[entry.begin] = (data[entry.begin] + 3) % 256
    path.write_bytes(bytes(data))
    rewrite_manifest_record(damaged, rel)
    report = verify(damaged, source=tiny_ckpt, numerics=True)
    assert any("l2.sf differs" in str(p) for p in report.problems)
    assert any("MoE output from the pre-baked layout differs" in str(p) for p in report.problems)


def test_deep_gemm_cross_check_compares_bytes(tiny_converted, tiny_ckpt, monkeypatch):
    """With a stand-in deep_gemm (the spec's math), the compare path runs and agrees;
    a deep_gemm that interleaves differently is reported."""
    def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups):
        assert recipe == (1, 32) and sf.dtype == torch.float32
        return scales.sf_into_required_layout(scales.narrow_fp32_to_ue8m0(sf))

    def transform_weights_for_mega_moe(l1, l2):
        l1_sf = transform.transpose_sf_for_utccp(transform.interleave_gate_up(l1[1]))
        return ((transform.interleave_gate_up(l1[0]), l1_sf),
                (l2[0], transform.transpose_sf_for_utccp(l2[1])))

    fake = types.SimpleNamespace(transform_sf_into_required_layout=transform_sf_into_required_layout,
                                 transform_weights_for_mega_moe=transform_weights_for_mega_moe)
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    monkeypatch.setattr(verify_deep_gemm, "deep_gemm_unavailable_reason", lambda: None)
    monkeypatch.setattr(verify_deep_gemm, "DEEP_GEMM_DEVICE", "cpu")
    report = verify(tiny_converted, source=tiny_ckpt, deep_gemm=True, sample=4)
    assert report.ok and report.checks["layers vs deep_gemm"] >= 1 and "deep_gemm" not in report.skipped

    fake.transform_weights_for_mega_moe = lambda l1, l2: ((transform.interleave_gate_up(l1[0], granularity=4),
                                                           transform_weights_for_mega_moe(l1, l2)[0][1]),
                                                          transform_weights_for_mega_moe(l1, l2)[1])
    report = verify(tiny_converted, source=tiny_ckpt, deep_gemm=True, sample=4)
    assert any("l1.weight differs from deep_gemm's own transform" in str(p) for p in report.problems)


def test_deep_gemm_skip_reason_is_explicit():
    reason = verify_deep_gemm.deep_gemm_unavailable_reason()
    if reason is None:
        pytest.skip("deep_gemm usable here")
    assert "deep_gemm is not installed" in reason or "SM100" in reason or "no CUDA" in reason
