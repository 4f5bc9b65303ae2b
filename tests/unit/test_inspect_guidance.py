"""What `inspect` and `verify` tell a user about what they are pointed at: a conversion and how to
serve it, sizes that match the files, partial conversions said as such, a source where a
conversion is expected."""

from __future__ import annotations

import json

from conftest import run_cli


def rank_dir_bytes(out, rank, ep):
    return sum(p.stat().st_size for p in (out / f"rank-{rank:05d}-of-{ep:05d}").iterdir())


def written_bytes(out):
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and ".megamoe" not in p.relative_to(out).parts)


# ----------------------------------------------------------------------------- inspect: sizes, conversions


def test_inspect_sizes_are_the_bytes_convert_writes(tiny_ckpt, tiny_converted):
    """Per rank and in all: the pre-baked shared expert, logical ids and headers are counted."""
    info = json.loads(run_cli("inspect", tiny_ckpt, "--ep-size", 4, "--num-redundant-experts", 4, "--json").stdout)
    sizes = info["conversion"]
    for rank in range(4):
        assert sizes["rank_bytes"][str(rank)] == rank_dir_bytes(tiny_converted, rank, 4)
    manifest_bytes = (tiny_converted / "manifest.json").stat().st_size
    assert sizes["total_bytes"] == written_bytes(tiny_converted) - manifest_bytes
    routed_only = info["expert_bytes"] * 12 // 8 // 4  # 3 of 12 slots per rank, routed tensors only
    assert sizes["expert_bytes_per_rank"] > routed_only  # the shared expert was not counted before
    assert f"{sizes['expert_bytes_per_rank'] / 1e3:.1f} KB per rank" in run_cli(
        "inspect", tiny_ckpt, "--ep-size", 4, "--num-redundant-experts", 4).stdout


def test_inspect_without_ep_size_works_and_lists_the_ep_sizes_that_work(tmp_path):
    src = tmp_path / "src"
    run_cli("synth", src, "--experts", 6, "-q")  # 6 experts: the old hidden --ep-size 8 failed
    info = json.loads(run_cli("inspect", src, "--json").stdout)
    assert info["working_ep_sizes"]["vllm"] == [1, 2, 3, 6] and "conversion" not in info
    assert "1, 2, 3, 6" in run_cli("inspect", src).stdout
    proc = run_cli("convert", src, tmp_path / "out", "--ep-size", 4, check=False)
    assert proc.returncode == 2 and "not divisible by ep_size=4" in proc.stderr
    assert "EP sizes that work for every selected MoE layer: 1, 2, 3, 6" in proc.stderr


def test_inspect_of_a_conversion_says_what_it_is_and_how_to_serve_it(tiny_converted):
    text = run_cli("inspect", tiny_converted).stdout
    assert "a megamoe conversion" in text and "vllm, EP 4" in text and "all of 4" in text
    command = (f"vllm serve {tiny_converted.resolve()} --load-format megamoe --data-parallel-size 4 "
               "--enable-expert-parallel --moe-backend deep_gemm_mega_moe --enable-eplb "
               "--eplb-config '{\"num_redundant_experts\": 4}'")
    assert command in text
    info = json.loads(run_cli("inspect", tiny_converted, "--json").stdout)
    assert info["kind"] == "conversion" and info["ep_size"] == 4 and info["ranks"] == [0, 1, 2, 3]
    assert info["engine"] == "vllm" and info["num_redundant_experts"] == 4 and info["placement"] == "default"
    assert info["partial"] is False and info["servable"] is True and info["path"] == str(tiny_converted.resolve())
    assert info["serve"]["vllm"] == {"servable": True, "command": command, "reason": "",
                                     # the tiny preset's I = 128: vLLM 0.30 pads it to 512 in finalize_weights
                                     "notes": ["vLLM 0.31-0.33 on Blackwell; one process per GPU (EP over data "
                                               "parallel)"], "gpus": ["Blackwell"]}
    assert info["serve"]["sglang"]["servable"] is False and "--engine sglang" in info["serve"]["sglang"]["reason"]
    assert info["sizes"]["total_bytes"] == written_bytes(tiny_converted)
    # the command's flags are vLLM's: their names are checked against the real parser in tests/engines


def test_inspect_of_an_sglang_conversion_gives_sglangs_command(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    run_cli("synth", src, "-q")
    # tiny has hidden 256 (SGLang needs a multiple of 512): the conversion says why it cannot be served
    run_cli("convert", src, out, "--ep-size", 2, "--engine", "sglang", "-q")
    info = json.loads(run_cli("inspect", out, "--json").stdout)
    assert info["serve"]["sglang"]["servable"] is False
    assert "hidden_size=256 is not a multiple of 512" in info["serve"]["sglang"]["reason"]
    assert info["serve"]["vllm"]["servable"] is False and "converted for sglang" in info["serve"]["vllm"]["reason"]


def test_partial_conversions_say_so_everywhere(tiny_ckpt, tmp_path):
    cases = {"ranks": ("--ranks", "0"), "layers": ("--layers", "0,mtp"), "experts_only": ("--experts-only",)}
    for name, args in cases.items():
        out = tmp_path / name
        proc = run_cli("convert", tiny_ckpt, out, "--ep-size", 2, *args)
        done = [line for line in proc.stderr.splitlines() if line.startswith("done:")][0]
        assert "partial:" in done, done
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["coverage"]["partial"] is True and manifest["coverage"]["servable"] is False
        verdict = run_cli("verify", out).stdout
        assert "OK" in verdict and "partial conversion" in verdict and "not servable" in verdict
        report = json.loads(run_cli("verify", out, "--json").stdout)
        assert report["ok"] is True and report["partial"] is True and report["servable"] is False
        info = json.loads(run_cli("inspect", out, "--json").stdout)
        assert info["partial"] is True and info["serve"]["vllm"]["servable"] is False
        assert info["serve"]["vllm"]["command"] == ""
    assert "holds ranks 0 of EP 2, not 1" in json.loads((tmp_path / "ranks" / "manifest.json").read_text())[
        "coverage"]["note"]
    assert "missing layers.1" in json.loads((tmp_path / "layers" / "manifest.json").read_text())["coverage"]["note"]
    full = tmp_path / "full"
    proc = run_cli("convert", tiny_ckpt, full, "--ep-size", 2)
    assert "partial:" not in proc.stderr and f"serve it: megamoe inspect {full}" in proc.stderr
    assert "a complete conversion" in run_cli("verify", full).stdout


# ----------------------------------------------------------------------------- verify's usage errors


def test_verify_of_a_source_checkpoint_is_a_usage_error(tiny_ckpt):
    proc = run_cli("verify", tiny_ckpt, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert f"{tiny_ckpt} is a source checkpoint, not a conversion" in proc.stderr
    assert "megamoe inspect" in proc.stderr


def test_verify_with_a_missing_source_fails_before_hashing(tiny_converted):
    proc = run_cli("verify", tiny_converted, "--source", "/nonexistent", check=False)
    assert proc.returncode == 2 and "/nonexistent" in proc.stderr
    assert "verify: hash" not in proc.stderr  # no phase started
