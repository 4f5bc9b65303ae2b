"""Every command README.md, docs/*.md and the Makefile show runs here, at a tiny size.

The shell and Python blocks of the documents are extracted; ``/models/...`` paths (and the ``SRC``
/ ``OUT`` placeholders) are mapped to a synthesised tiny checkpoint and to outputs in a temporary
directory, EP sizes and redundant experts to ones its 8 experts allow. Engine serve commands need a
GPU: their flags are parsed by the real engine's own argument parser in its environment instead.
A command that cannot run here is listed in NOT_RUNNABLE with the reason; a documented command
that is neither run nor listed fails the test, so no documented command can break unnoticed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = ("bash", "sh", "shell", "console")

#: Documented commands that do not run here, each with the reason (matched by the command's start).
NOT_RUNNABLE = {
    "python3 -m pip install .": "installs into the running environment; CI's `make test` installs the same "
                                "project with `pip install -e '.[test]'`",
    "python3 -m pip install torch --index-url ": "installs torch into the running environment; the Makefile installs "
                                                 "the same CPU build into .venv where no NVIDIA driver answers",
    "/path/to/engine-env/bin/python -m pip install ": "installs into an engine's environment: tests/engine_envs.py "
                                                      "builds each engine's environment with the project on its path",
    "RUN pip install ": "a Dockerfile line (the same pip install, inside an image build)",
    "make test-fast": "the unit tier of this suite, which make test runs (.ci/run)",
    "make test": "is CI itself (.ci/run)",
    "make demo": "runs below, recipe by recipe (test_make_demo_runs), without rebuilding the environment",
    "megamoe push ": "needs the Hugging Face hub: tests/unit/test_hub.py runs push against its fake hub",
    "megamoe pull ": "needs the Hugging Face hub: tests/unit/test_hub.py runs pull against its fake hub",
    "megamoe convert deepseek-ai/": "downloads from the Hugging Face hub: tests/unit/test_hub.py converts a fake "
                                    "hub repo",
    "megamoe merge OUT [PART_DIR": "a template (needs every part first): tests/unit/test_fleet.py splits and merges",
    "megamoe merge /models/V4-Pro-ep64 /scratch": "a template (needs every part first): tests/unit/test_fleet.py",
    "megamoe convert SRC OUT --ep-size 64 --shard": "one part of a split template: tests/unit/test_fleet.py splits "
                                                   "and merges",
    "PYTHONPATH=. python3 benchmarks/": "a benchmark run (GPU or minutes): every script's smoke mode runs in "
                                        "tests/e2e/test_benchmarks.py",
    "megamoe preload ": "starts vLLM's or SGLang's weight-cache daemons (needs GPUs): "
                        "tests/engines/test_vllm_weight_cache.py and test_sglang_weight_cache.py run it in the "
                        "engines' real code",
    "vllm serve ": "needs GPUs: its flags are parsed by vLLM 0.33's own parser (test_serve_commands_parse)",
    "python -m sglang.launch_server ": "needs GPUs: its flags are parsed by SGLang's own parser",
}
#: The README's stand-in for the engine environment's python: its plugin check runs with this environment's.
ENGINE_PYTHON = "/path/to/engine-env/bin/python -c "
PYTHON_NOT_RUNNABLE = {
    "install(model,": "needs an engine's model: tests/engines run install() in vLLM's and SGLang's real code",
    'load_rank("my-org/': "reads from the Hugging Face hub: tests/unit/test_hub.py loads from its fake hub",
}


def blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block of a Markdown file (indented fences too)."""
    found, lang, lines, indent = [], None, [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if lang is None and stripped.startswith("```"):
            lang, lines, indent = stripped[3:].strip() or "text", [], line[:len(line) - len(line.lstrip())]
        elif lang is not None and stripped.startswith("```"):
            found.append((lang, "\n".join(lines)))
            lang = None
        elif lang is not None:
            lines.append(line[len(indent):] if line.startswith(indent) else line)
    return found


def shell_commands(text: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments dropped."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            commands.append(re.sub(r"\s+", " ", line))
    return commands


def documented() -> list[tuple[Path, str, str]]:
    """``(file, language, command or snippet)`` of every runnable-looking block, in document order."""
    items = []
    for path in DOCS:
        for lang, text in blocks(path):
            if lang in SHELL_FENCES:
                items += [(path, "sh", c) for c in shell_commands(text)]
            elif lang == "python":
                items.append((path, "python", text))
    return items


def reason_not_runnable(kind: str, text: str) -> str | None:
    table = NOT_RUNNABLE if kind == "sh" else PYTHON_NOT_RUNNABLE
    return next((why for start, why in table.items() if (text.startswith(start) if kind == "sh" else start in text)),
                None)


class TinyWorld:
    """Maps documented paths and sizes to a tiny checkpoint (8 experts) and a temporary directory."""

    SOURCES = ("DeepSeek-V4-Pro", "DeepSeek-V4-Flash")

    def __init__(self, root: Path, tiny: Path) -> None:
        self.root, self.tiny = root, tiny
        (root / "models").mkdir(parents=True, exist_ok=True)
        for name in self.SOURCES:
            if not (root / "models" / name).exists():
                shutil.copytree(tiny, root / "models" / name)

    @staticmethod
    def ep(n: int) -> int:
        return n if n <= 8 and 8 % n == 0 else 4

    def command(self, line: str) -> list[str]:
        line = re.sub(r"\s\[[^\]]*\]", "", line)  # optional parts
        line = line.replace("/models/", f"{self.root}/models/")
        words = shlex.split(line)
        words = [str(self.tiny) if w == "SRC" else str(self.root / "OUT") if w == "OUT" else w for w in words]
        out = []
        ep = 8
        for i, w in enumerate(words):
            if i and words[i - 1] == "--ep-size":
                ep = self.ep(int(w))
                w = str(ep)
            elif i and words[i - 1] == "--num-redundant-experts":
                w = str(ep)
            out.append(w)
        return out


def run_megamoe(args: list[str]) -> subprocess.CompletedProcess[str]:
    """A documented ``megamoe`` command, through the console script's own entry in this process
    (``tests/cli_runs.py``: what a command sets process-wide is put back after it)."""
    return run_cli(*args, check=False)


def test_every_documented_command_runs_or_says_why_not(tiny_ckpt, tmp_path):
    world = TinyWorld(tmp_path, tiny_ckpt)
    ran = 0
    for path, kind, text in documented():
        if reason_not_runnable(kind, text):
            continue
        where = f"{path.relative_to(REPO)}: {text.splitlines()[0]}"
        if kind == "sh" and text.startswith(ENGINE_PYTHON):  # the plugin check: our own environment has it
            proc = subprocess.run([sys.executable, *shlex.split(text)[1:]], capture_output=True, text=True, cwd=REPO,
                                  timeout=120)
            assert proc.returncode == 0 and "megamoe_convert" in proc.stdout, f"{where}\n{proc.stdout}{proc.stderr}"
        elif kind == "sh":
            assert text.startswith("megamoe "), f"{where}: neither run here nor listed in NOT_RUNNABLE"
            proc = run_megamoe(world.command(text)[1:])
            assert proc.returncode == 0, f"{where}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        else:
            code = text.replace("/models/", f"{tmp_path}/models/").replace('device="cuda"', 'device="cpu"')
            code = re.sub(r"layers\.\d+\.ffn", "layers.1.ffn", code)  # the tiny checkpoint has layers 0-1
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
            assert proc.returncode == 0, f"{where}\n{proc.stderr[-2000:]}"
        ran += 1
    assert ran >= 10


def test_documented_serve_commands_are_what_inspect_prints(tiny_ckpt, tmp_path):
    """The README's vLLM command for an EP 8 conversion is the one `megamoe inspect OUT` gives."""
    out = tmp_path / "models" / "V4-Flash-ep8"
    assert run_megamoe(["convert", str(tiny_ckpt), str(out), "--ep-size", "8", "-q"]).returncode == 0
    printed = json.loads(run_megamoe(["inspect", str(out), "--json"]).stdout)["serve"]["vllm"]["command"]
    serve = [c for path, kind, c in documented()
             if kind == "sh" and c.startswith("vllm serve /models/V4-Flash-ep8 --load-format megamoe")]
    assert serve and all(c.replace("/models/", f"{tmp_path}/models/") == printed for c in serve), (serve, printed)


def serve_flags(prefix: str) -> list[list[str]]:
    return [shlex.split(re.sub(r"\s\[[^\]]*\]", "", c))[len(prefix.split()):]
            for _, kind, c in documented() if kind == "sh" and c.startswith(prefix)]


PARSE_VLLM = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
for flags in json.loads(sys.argv[1]):
    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", flags[0], *flags[1:]])
    # ipc_cache: the daemon door
    assert args.load_format in ("megamoe", "ipc_cache") and args.enable_expert_parallel, flags
print("parsed", len(json.loads(sys.argv[1])))
"""


@pytest.mark.engines  # builds or reuses an engine's environment (tests/engine_envs.py)
def test_serve_commands_parse_with_vllms_own_parser(tiny_ckpt, tmp_path):
    """Documented `vllm serve` commands, and the one `inspect` prints with redundant experts, are
    accepted by vLLM 0.33's real argument parser (a flag vLLM does not know fails here)."""
    sys.path.insert(0, str(REPO / "tests"))
    from engine_envs import ensure

    out = tmp_path / "ep4"
    assert run_megamoe(["convert", str(tiny_ckpt), str(out), "--ep-size", "4", "--num-redundant-experts", "4",
                        "-q"]).returncode == 0
    printed = json.loads(run_megamoe(["inspect", str(out), "--json"]).stdout)["serve"]["vllm"]["command"]
    commands = serve_flags("vllm serve") + [shlex.split(printed)[2:]]
    assert len(commands) >= 3 and any("--enable-eplb" in c for c in commands)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, ensure("vllm==0.33.0")), str(REPO)]),
           "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", PARSE_VLLM, json.dumps(commands)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0 and f"parsed {len(commands)}" in proc.stdout, proc.stderr[-3000:]


PARSE_SGLANG = """
import argparse, json, sys
from megamoe_convert.engines.sglang import plugin
plugin.register()  # what the sglang.srt.plugins entry point does at start-up
from sglang.srt.server_args import ServerArgs
for flags in json.loads(sys.argv[1]):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(flags)
    # every documented way: the load format, presharded over a conversion, or the weight-cache daemon's client
    assert args.load_format in ("megamoe", "presharded") or args.weight_cache_mode == "client", flags
print("parsed", len(json.loads(sys.argv[1])))
"""


@pytest.mark.engines  # builds or reuses an engine's environment (tests/engine_envs.py)
def test_sglang_launch_commands_parse_with_sglangs_own_parser():
    sys.path.insert(0, str(REPO / "tests"))
    from engine_envs import ensure

    commands = serve_flags("python -m sglang.launch_server")
    assert commands
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, ensure("sglang==0.5.23")), str(REPO)]),
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", PARSE_SGLANG, json.dumps(commands)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0 and f"parsed {len(commands)}" in proc.stdout, proc.stderr[-3000:]


def makefile_recipe(target: str) -> list[str]:
    lines, inside = [], False
    for line in (REPO / "Makefile").read_text().splitlines():
        if re.match(rf"^{target}:", line):
            inside = True
        elif inside and line.startswith("\t"):
            lines.append(line[1:])
        elif inside:
            break
    return lines


def test_make_demo_runs(tmp_path):
    """`make demo`'s recipe, line by line, with this test run's environment in place of $(VENV): its
    `megamoe` lines through the console script's entry in this process (their paths under the recipe's
    folder), the others in a shell."""
    recipe = makefile_recipe("demo")
    assert recipe and any("megamoe_convert.cli.demo" in line for line in recipe)
    venv_bin = Path(sys.executable).parent
    for line in recipe:
        if line.startswith("$(VENV)/bin/megamoe "):
            args = [str(tmp_path / a) if a.startswith("demo-out/") else a for a in shlex.split(line)[1:]]
            proc = run_cli(*args, check=False, timeout=600)
            assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            continue
        line = line.replace("$(PY)", sys.executable).replace("$(VENV)/bin", str(venv_bin))
        proc = subprocess.run(line, shell=True, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert (tmp_path / "demo-out" / "converted" / "manifest.json").exists()


def test_links_resolve_inside_the_repository():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.exists() and REPO in resolved.parents, f"{path.relative_to(REPO)}: {target}"


def test_layout_contract_is_a_copy_of_the_specification():
    text = (REPO / "docs" / "megamoe-layout.md").read_text()
    assert "byte-exact contract" in text.split("\n\n")[1]
    assert "UTCCP transpose" in text and "transform_weights_for_mega_moe" in text


@pytest.mark.parametrize("doc", ["docs/fleet.md", "README.md"])
def test_no_install_of_an_unpublished_distribution(doc):
    assert "pip install megamoe-convert" not in (REPO / doc).read_text()
