"""A newcomer's first run, on a fresh copy of the tree as a clone of it would hold it (what is being
submitted, not the last commit): the command line as they meet it, each of the tool's own outputs
(finished, unfinished, a store, experts-only, another engine's) fed back to the commands, and every
answer saying what it is and what to do next."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


def copy_tree(dest: Path) -> None:
    """The files a clone of the working tree would hold: tracked ones as they are now and untracked
    ones git does not ignore (a file deleted but not yet committed is left out)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True, timeout=120).stdout
    for name in sorted({os.fsdecode(n) for n in listed.split(b"\0") if n}):
        src = REPO / name
        if src.is_file() or src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)


class Clone:
    """A fresh copy of the tree (:func:`copy_tree`), its command line run from it (its own code, not
    the tree's)."""

    def __init__(self, root: Path) -> None:
        self.root = root / "megamoe-convert"
        copy_tree(self.root)
        self.work = root / "work"
        self.work.mkdir()

    def run(self, *args: object, env: dict[str, str] | None = None, code: int | None = 0,
            ) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, "PYTHONPATH": str(self.root), "COLUMNS": "200", **(env or {})}
        proc = subprocess.run([sys.executable, "-m", "megamoe_convert.cli", *map(str, args)], capture_output=True,
                              text=True, cwd=self.work, env=full_env, timeout=300)
        text = proc.stdout + proc.stderr
        assert "install megamoe-convert" not in text, text
        assert "Traceback" not in text or "--debug" in map(str, args), text
        if code is not None:
            assert proc.returncode == code, f"{args}: exit {proc.returncode}\n{text[-3000:]}"
        return proc


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Clone:
    c = Clone(tmp_path_factory.mktemp("first-run"))
    c.run("synth", "ckpt", "-q")
    c.run("convert", "ckpt", "out", "--ep-size", 4, "-q")
    return c


def test_the_clone_runs_its_own_code(clone):
    proc = subprocess.run([sys.executable, "-c", "import megamoe_convert; print(megamoe_convert.__file__)"],
                          capture_output=True, text=True, cwd=clone.work,
                          env={**os.environ, "PYTHONPATH": str(clone.root)})
    assert Path(proc.stdout.strip()).is_relative_to(clone.root)


def test_a_checkpoint_says_what_it_is_and_what_to_do_next(clone):
    info = json.loads(clone.run("inspect", "ckpt", "--json").stdout)
    assert info["kind"] == "checkpoint" and info["working_ep_sizes"]["vllm"] == [1, 2, 4, 8]
    assert info["next"].startswith("convert it: megamoe convert SRC OUT --ep-size N")


def test_a_finished_conversion_prints_its_serve_command(clone):
    text = clone.run("inspect", "out").stdout
    assert "a megamoe conversion" in text and "--data-parallel-size 4" in text
    info = json.loads(clone.run("inspect", "out", "--json").stdout)
    assert info["kind"] == "conversion" and info["next"] == "serve it (the command above)"


def test_planning_a_conversion_points_at_its_source(clone):
    """The tool's own output as plan's source: what it is, and the plan that answers the question."""
    err = clone.run("plan", "out", "--ep-size", 8, code=2).stderr
    assert err.startswith("error: out: a megamoe conversion of deepseek_v4 for EP 4 (vllm), not a source checkpoint")
    assert f"megamoe plan {clone.work / 'ckpt'} --ep-size 8" in err and "megamoe inspect out" in err
    err = clone.run("convert", "out", "again", "--ep-size", 2, code=2).stderr
    assert "not a source checkpoint; convert its source instead" in err and not (clone.work / "again").exists()


def test_an_interrupted_conversion_says_how_to_finish_it(clone):
    unfinished = clone.work / "unfinished"
    shutil.copytree(clone.work / "out", unfinished)
    (unfinished / "manifest.json").unlink()  # what a stop before the last step leaves
    text = clone.run("inspect", "unfinished").stdout
    assert "an unfinished megamoe conversion for EP 4" in text
    resume = f"megamoe convert {clone.work.resolve() / 'ckpt'} unfinished --ep-size 4"  # the real SRC, pasteable
    assert f"next: rerun the convert that made it to finish it, from where it stopped: {resume}" in text
    assert json.loads(clone.run("inspect", "unfinished", "--json").stdout)["kind"] == "unfinished"
    assert resume in clone.run("plan", "unfinished", "--ep-size", 4, code=2).stderr
    verified = clone.run("verify", "unfinished", code=1).stdout
    assert "a `megamoe convert` into it was interrupted (or is still running); rerun that command" in verified
    clone.run("convert", "ckpt", "unfinished", "--ep-size", 4, "-q")  # the advice works: it resumes
    assert json.loads(clone.run("inspect", "unfinished", "--json").stdout)["servable"]


def test_preload_of_a_source_says_to_convert_it_first(clone):
    err = clone.run("preload", "--model", "ckpt", code=2).stderr
    assert "ckpt is not a megamoe conversion (a source checkpoint?): convert it first" in err


def test_a_store_is_said_served_and_loaded_at_any_ep_size(clone):
    done = clone.run("convert", "ckpt", "store").stderr
    assert "store is a store (no --ep-size: every logical expert once, served at any EP size" in done
    text = clone.run("inspect", "store").stdout
    assert "EP sizes for vllm" in text and "1, 2, 4, 8" in text
    assert "vllm serve" in text and "--data-parallel-size N" in text and "(N: any of 1, 2, 4, 8)" in text
    store = json.loads(clone.run("inspect", "store", "--ep-size", 4, "--json").stdout)
    conversion = json.loads(clone.run("inspect", "out", "--json").stdout)
    shared = {"kind", "path", "family", "model_family", "weight_format", "engine", "ep_size", "layers", "experts_only",
              "n_routed_experts", "num_redundant_experts", "shared_expert_prebaked", "layout", "partial", "servable",
              "coverage", "sizes", "serve", "source", "next"}
    assert shared <= set(store) and shared <= set(conversion)
    assert store["serve"]["vllm"]["command"] == conversion["serve"]["vllm"]["command"].replace(
        str(clone.work / "out"), str(clone.work / "store"))
    assert len(store["reads"]["ranks"]) == 4
    same = subprocess.run([sys.executable, "-c", """
import sys, torch
from megamoe_convert import load_rank
a, b = load_rank("store", rank=3, ep_size=4), load_rank("out", rank=3, ep_size=4)
assert a.keys() == b.keys()
for k in a:
    assert a[k].logical_ids == b[k].logical_ids
    assert all(torch.equal(x, y) and x.stride() == y.stride()
               for x, y in zip((*a[k].l1, *a[k].l2), (*b[k].l1, *b[k].l2), strict=True))
try:
    load_rank("store", rank=3)
except Exception as e:
    print(e)
"""], capture_output=True, text=True, cwd=clone.work, env={**os.environ, "PYTHONPATH": str(clone.root)})
    assert same.returncode == 0, same.stderr
    assert "is a store (every logical expert once, for any EP size): name the EP size" in same.stdout
    assert "ep_size=N" in same.stdout


def test_reconverting_names_only_the_options_that_differ(clone):
    err = clone.run("convert", "ckpt", "out", "--ep-size", 4, "--num-redundant-experts", 4, code=2).stderr
    assert "different options (--num-redundant-experts 0 -> 4)" in err and "--overwrite" in err
    err = clone.run("convert", "ckpt", "out", "--ep-size", 2, code=2).stderr
    assert "different options (--ep-size 4 -> 2)" in err  # not the ranks or slots it implies
    err = clone.run("convert", "ckpt", "store", "--ep-size", 2, code=2).stderr
    assert "different options (--ep-size none (a store) -> 2)" in err


def test_an_experts_only_conversion_says_it_is_not_servable(clone):
    done = clone.run("convert", "ckpt", "experts", "--ep-size", 4, "--experts-only").stderr
    assert "partial" in done and "serve it" not in done
    info = json.loads(clone.run("inspect", "experts", "--json").stdout)
    assert not info["servable"] and "--experts-only" in info["next"]


def test_converting_for_an_engine_that_cannot_serve_the_shapes_says_so(clone):
    """The tiny preset's hidden size is below SGLang's MegaMoE minimum: no "serve it"."""
    done = clone.run("convert", "ckpt", "sgl", "--ep-size", 2, "--engine", "sglang").stderr
    assert "sglang cannot serve it: hidden_size=256 is not a multiple of 512" in done
    assert "; serve it: megamoe inspect" not in done


def test_push_without_a_network_is_one_line(clone):
    err = clone.run("push", "out", "someone/tiny", env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "x"},
                    code=2).stderr
    assert err.count("\n") == 1 and "cannot reach the Hugging Face hub at http://127.0.0.1:9" in err
    err = clone.run("push", "out", "someone/tiny", env={"HF_HUB_OFFLINE": "1"}, code=2).stderr
    assert err.count("\n") == 1 and "HF_HUB_OFFLINE is set" in err


def test_debug_works_after_the_command_too(clone):
    for args in (("--debug", "plan", "out", "--ep-size", 8), ("plan", "out", "--ep-size", 8, "--debug")):
        proc = clone.run(*args, code=None)
        assert proc.returncode != 0 and "Traceback" in proc.stderr and "UsageError" in proc.stderr


def torch_install_args(tmp_path: Path, local_wheel: bool, gpu: bool) -> str:
    """What the Makefile's set-up step passes to ``pip install torch==2.13.0``, its shell lines run as
    written with a stand-in python (recording the install, answering the local-wheel probe) and a
    PATH with or without ``nvidia-smi``."""
    text = (REPO / "Makefile").read_text()
    recipe = text.split("$(STAMP): pyproject.toml\n", 1)[1].split("\n\n", 1)[0]
    lines = [line[1:] for line in recipe.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("@args="))
    end = next(i for i in range(start, len(lines)) if "torch==2.13.0 $$args" in lines[i] and "pip install" in lines[i])
    snippet = "\n".join(lines[start:end + 1]).lstrip("@")
    index = next(line.split(":=", 1)[1].strip() for line in text.splitlines() if line.startswith("TORCH_CPU_INDEX"))
    bin_dir = tmp_path / f"bin-{local_wheel}-{gpu}"
    bin_dir.mkdir()
    record = bin_dir / "installed"
    python = bin_dir / "python"
    python.write_text(f"#!/bin/sh\ncase \"$*\" in *--dry-run*) exit {0 if local_wheel else 1};; esac\n"
                      f"echo \"$*\" > {record}\n")
    python.chmod(0o755)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    snippet = (snippet.replace("$(TORCH_PIP_ARGS)", "").replace("$(TORCH_CPU_INDEX)", index)
               .replace("$(PY)", str(python)).replace("$(VENV)", str(bin_dir)).replace("$$", "$"))
    subprocess.run(["/bin/sh", "-c", snippet], check=True, capture_output=True,
                   env={"PATH": str(bin_dir)})  # the shell's builtins only: no nvidia-smi but the stand-in
    return record.read_text().split("torch==2.13.0", 1)[1].strip()


def test_set_up_picks_torchs_cpu_build_only_where_nothing_else_fits(tmp_path):
    """No GPU and no local torch==2.13.0: PyTorch's CPU index; a local wheel (CI) or a GPU: pip as configured."""
    assert torch_install_args(tmp_path, local_wheel=False, gpu=False) == \
        "--index-url https://download.pytorch.org/whl/cpu"
    assert torch_install_args(tmp_path, local_wheel=True, gpu=False) == ""
    assert torch_install_args(tmp_path, local_wheel=False, gpu=True) == ""
