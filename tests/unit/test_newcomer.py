"""What a newcomer meets first says what is true and what to do: a folder that is no checkpoint, an
output inside its source, a GPU flag without a GPU, a folder verify cannot check, an interrupted
conversion's resume command, the cost of ``verify --numerics``, the demo's placement, ``preload``
outside vLLM's environment, and ``synth``'s memory."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import output_files, run_cli

from megamoe_convert.cli import demo
from megamoe_convert.synth import write


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert proc.stdout == ""  # nothing that looks like a result
    return lines[0]


def test_convert_of_a_folder_without_config_json_says_it_is_no_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not a model\n")
    proc = run_cli("convert", tmp_path / "notes", tmp_path / "out", "--ep-size", 2, check=False)
    assert one_error_line(proc) == f"error: {tmp_path / 'notes'}: not a checkpoint directory (no config.json)"
    assert not (tmp_path / "out").exists()


def test_output_inside_the_source_is_refused(tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    before = output_files(src)
    for out in (src / "converted", src / "deeper" / "converted"):
        line = one_error_line(run_cli("convert", src, out, "--ep-size", 2, check=False))
        assert f"{out}: is inside the source checkpoint being converted" in line
        assert output_files(src) == before and sorted(p.name for p in src.iterdir() if p.is_dir()) == []


def test_cuda_without_a_gpu_says_to_leave_out_the_flag(tiny_ckpt, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = one_error_line(run_cli("convert", tiny_ckpt, tmp_path / "out", "--ep-size", 2, "--device", "cuda",
                                  check=False))
    assert line.endswith("no CUDA GPU is available to this process; leave out --device to run on the CPU "
                         "(the default)")


def test_verify_of_a_folder_that_is_neither_conversion_nor_checkpoint_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing converted here\n")
    line = one_error_line(run_cli("verify", tmp_path, check=False))
    assert line == (f"error: {tmp_path} is neither a megamoe conversion (no manifest.json) nor a checkpoint: "
                    "`megamoe verify` checks what `megamoe convert` wrote")


def test_resume_hint_names_the_source_it_was_reading_and_resumes(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "-q")
    (out / "manifest.json").unlink()  # what a stop before the last step leaves
    hint = run_cli("inspect", out).stdout.splitlines()[-1]
    command = f"megamoe convert {shlex.quote(str(tiny_ckpt.resolve()))} {shlex.quote(str(out))} --ep-size 2"
    assert hint.endswith(f"from where it stopped: {command}"), hint
    run_cli(*shlex.split(command)[1:], "-q")  # the printed command, pasted, finishes it
    assert run_cli("verify", out).returncode == 0


def test_numerics_cost_follows_the_comparison_it_comes_after(tiny_converted, tiny_ckpt):
    lines = run_cli("verify", tiny_converted, "--source", tiny_ckpt, "--numerics", "--ranks", 0).stderr.splitlines()
    compared = next(i for i, line in enumerate(lines) if line.startswith("verify: compare source: finished"))
    cost = next(i for i, line in enumerate(lines) if line.startswith("numerics: "))
    started = next(i for i, line in enumerate(lines) if line.startswith("verify: numerics"))
    assert compared < cost < started, lines
    assert lines[cost].startswith("numerics: 3 checks (every MoE layer once") and "holding up to about " in lines[cost]


def test_demo_says_why_a_rank_holds_redundant_slots(tiny_converted, capsys):
    assert demo.main(str(tiny_converted)) == 0
    text = capsys.readouterr().out
    assert ("placement: 8 experts + 4 redundant = 12 slots, 3 per rank; slot s holds expert s mod 8 (vLLM's default "
            "placement), so slots 8-11 hold a second copy of experts 0, 1, 2, 3") in text
    assert "rank 2: 3 layers, slots 6-8 hold logical experts [6, 7, 0];" in text
    assert "\n  megamoe convert /path/to/checkpoint OUT --ep-size N\n" in text and "  " not in text.replace("\n  ", "")


def test_preload_without_vllm_says_which_python_to_run_it_with(tiny_ckpt, tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    out = tmp_path / "out"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 2, "-q")
    line = one_error_line(run_cli("preload", "--model", out, check=False))
    assert f"needs vLLM >= 0.33, which {sys.executable} cannot import" in line
    assert line.endswith("VLLM_ENV/bin/python -m megamoe_convert.cli preload --model OUT ...")


def test_synth_makes_a_large_tensor_in_pieces_with_the_same_bytes(tmp_path, monkeypatch):
    """A tensor is generated a piece at a time (memory holds one piece, not a vocabulary's embedding
    several times over), and the pieces are the bytes one draw makes."""
    write.synthesize(tmp_path / "whole", "tiny", seed=5)
    monkeypatch.setattr(write, "SYNTH_CHUNK_BYTES", 4096)
    embed = next(t for t in write.checkpoint_tensors(write.load_preset("tiny")) if t.name == "embed.weight")
    pieces = list(write._tensor_chunks(embed, np.random.default_rng(0)))
    assert embed.nbytes > 4096 and len(pieces) == embed.nbytes // 4096 and {len(p) for p in pieces} == {4096}
    write.synthesize(tmp_path / "pieces", "tiny", seed=5)
    assert output_files(tmp_path / "pieces") == output_files(tmp_path / "whole")
