#!/usr/bin/env python3
"""Build ``.device/``: what a GPU machine with Python 3.12, torch and no network needs to run the
device benchmarks (``device_node.sh``, ``device_startup.sh``) from a clean checkout.

It starts from the engine environments the tests build (``tests/engine_envs.py``: each engine's own
folder, installed ``--no-deps``, and its import-chain folders) and keeps only what the benchmarks'
imports reach: a child process here imports every engine module that the benchmarks, the engine
harnesses and ``megamoe_convert.engines`` name, and every module of ``megamoe_convert``, with an
import hook recording each module loaded; a distribution is carried when one of its modules was.
Pure-Python files travel as they are (tests, ``__pycache__``, headers, web assets and binaries
left out); a distribution whose compiled extension was imported travels as its cp312 wheel
(downloaded with pip); compiled extensions nobody imported are dropped. What the device's Python
already has (torch and what it needs, safetensors, tokenizers) is not carried.

    .device/vllm-0.33.0.tar.xz   the engine's own folder (vLLM and its transformers): /tmp/v33 there
    .device/site.tar.xz          the import chains' and the project's pure-Python needs: /tmp/site
    .device/whl/*.whl            cp312 wheels of the compiled ones (and --load-formats'): into /tmp/site
    .device/tree.tar             ``git archive HEAD`` of the code (the committed tree): /tmp/tree
    .device/contents.json        what was chosen, and the sizes

    python benchmarks/device_carry.py                       # vLLM 0.33: the node, daemon, probe runs
    python benchmarks/device_carry.py --engines vllm==0.33.0,vllm==0.32.0 --load-formats   # start-up, node
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(REPO / "tests"))

#: What a call may carry in all (the working tree counts too).
CARRY_LIMIT = 64 << 20
#: Distributions the device's Python has: torch with what it needs, and what KINDS lists in versions
#: the engines accept (transformers checks tokenizers and safetensors at import).
DEVICE_HAS = {"torch", "numpy", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock",
              "fsspec", "typing-extensions", "setuptools", "safetensors", "tokenizers", "sentencepiece",
              "megamoe-convert"}
#: vLLM's load formats beside `auto` (vLLM 0.33 asks fastsafetensors>=0.3.3, instanttensor>=0.2.2,
#: runai-model-streamer>=0.15.7): wheels only, imported on a GPU alone.
LOAD_FORMATS = ["fastsafetensors==0.5.0", "instanttensor==0.2.2", "runai-model-streamer==0.17.0"]
#: Where each engine's own folder unpacks on the device (the device scripts' paths).
TARGETS = {"vllm==0.33.0": "/tmp/v33", "vllm==0.32.0": "/tmp/v32", "sglang==0.5.23": "/tmp/sglang"}
#: Files that no import reads: by suffix, and by folder name.
SKIP_SUFFIXES = (".pyc", ".pyi", ".h", ".hpp", ".cuh", ".cu", ".c", ".cc", ".cpp", ".cxx", ".inl", ".a", ".js",
                 ".css", ".html", ".map", ".svg", ".png", ".jpg", ".ico", ".woff", ".woff2", ".ttf", ".md",
                 ".rst", ".so", ".pyd", ".dll", ".dylib", ".exe")
SKIP_DIRS = {"__pycache__", "tests", "test", "bin", "include"}
SKIP_META = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]

#: Written as sitecustomize.py into the traced process's path: each module name loaded, as it loads.
TRACER = """
import os, sys
_out = open(os.environ["MEGAMOE_TRACE_FILE"], "a")
_seen = set(sys.modules)
_out.write("\\n".join(_seen) + "\\n")
def _hook(event, args):
    if event == "import" and args[0] not in _seen:
        _seen.add(args[0])
        _out.write(args[0] + "\\n")
        _out.flush()
sys.addaudithook(_hook)
"""
IMPORTS = re.compile(r"^\s*(?:from|import)\s+((?:vllm|sglang)(?:\.\w+)*)", re.M)


# --------------------------------------------------------------------------------------
# What the benchmarks import
# --------------------------------------------------------------------------------------

def engine_modules(engine: str) -> list[str]:
    """Every ``vllm.*`` (or ``sglang.*``) module that the benchmarks, the harnesses and the project's
    engine code import, found in their source."""
    package = engine.split("==")[0]
    sources = [*BENCH.glob("*.py"), *(REPO / "tests" / "engines").glob("*harness*.py"),
               *(REPO / "megamoe_convert" / "engines").rglob("*.py")]
    found = {m for path in sources for m in IMPORTS.findall(path.read_text()) if m.split(".")[0] == package}
    return sorted(found)


def trace(engine: str, layers: list[Path]) -> set[str]:
    """The modules loaded by importing :func:`engine_modules` and all of ``megamoe_convert`` in a child
    process on the engine's path (the CPU platform, as on the device)."""
    script = ("import importlib, pkgutil, sys\nimport megamoe_convert\n"
              "names = [m.name for m in pkgutil.walk_packages(megamoe_convert.__path__, 'megamoe_convert.')\n"
              "         if not m.name.endswith('__main__')]\n"
              "for name in names + sys.argv[1:]:\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except Exception as exc:\n        print('not imported:', name, type(exc).__name__, exc)\n")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(TRACER)
        log = Path(tmp, "modules.txt")
        path = [tmp, *map(str, layers), str(REPO), str(BENCH), str(REPO / "tests" / "engines")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "MEGAMOE_TRACE_FILE": str(log),
               "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run([sys.executable, "-c", script, *engine_modules(engine)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"tracing {engine}'s imports failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        print("".join(line + "\n" for line in proc.stdout.splitlines() if line.startswith("not imported")), end="")
        return set(log.read_text().split())


# --------------------------------------------------------------------------------------
# Distributions, and which of their files travel
# --------------------------------------------------------------------------------------

class Dist:
    """One installed distribution in ``folder``: its files, and the modules its top level holds."""

    def __init__(self, dist: metadata.Distribution, folder: Path) -> None:
        self.name = dist.metadata["Name"].lower().replace("_", "-")
        self.version, self.folder = dist.version, folder
        self.files = [Path(str(f)) for f in dist.files or [] if not str(f).startswith("..")]
        self.tops = {top_name(f) for f in self.files} - {None}

    def extensions(self) -> dict[str, Path]:
        """module name -> file of each compiled extension module."""
        found = {}
        for f in self.files:
            if f.suffix in (".so", ".pyd"):
                found[".".join([*f.parent.parts, f.name.split(".")[0]])] = f
        return found

    def pure_files(self) -> list[Path]:
        """The files that travel as they are: sources, data and metadata."""
        keep = []
        for f in self.files:
            meta = f.parts[0].endswith(".dist-info")
            if meta and f.name in SKIP_META or not meta and (f.suffix in SKIP_SUFFIXES or ".so." in f.name
                                                             or SKIP_DIRS & set(f.parts[:-1])
                                                             or f.parts[0].endswith(".libs")):
                continue
            path = self.folder / f
            if path.is_file() and not is_binary(path):
                keep.append(f)
        return keep


def top_name(f: Path) -> str | None:
    """The importable top-level name a distribution's file belongs to (None for metadata and scripts)."""
    first = f.parts[0]
    if first.endswith((".dist-info", ".egg-info", ".libs", ".data")) or first in ("bin", "__pycache__"):
        return None
    if len(f.parts) == 1:
        return first.split(".")[0] if f.suffix in (".py", ".so", ".pyd") else None
    return first


def is_binary(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == b"\x7fELF"


def installed(folder: Path) -> list[Dist]:
    return [Dist(d, folder) for d in metadata.distributions(path=[str(folder)])]


def select(folders: list[Path], modules: set[str]) -> list[Dist]:
    """The distributions the traced ``modules`` came from, each from the first folder on the path that
    holds its top-level name (as the import found it), less those the device has."""
    owner: dict[str, Dist] = {}
    for folder in folders:
        for dist in installed(folder):
            for top in dist.tops:
                owner.setdefault(top, dist)
    chosen = {id(owner[top]): owner[top] for top in {m.split(".")[0] for m in modules} if top in owner}
    return sorted((d for d in chosen.values() if d.name not in DEVICE_HAS), key=lambda d: d.name)


def needs_wheel(dist: Dist, modules: set[str]) -> bool:
    """Whether any compiled extension of ``dist`` was imported (then its cp312 wheel travels)."""
    return any(name in modules for name in dist.extensions())


# --------------------------------------------------------------------------------------
# Building .device/
# --------------------------------------------------------------------------------------

def download(specs: list[str], dest: Path) -> None:
    """cp312 manylinux wheels of ``specs`` (exact pins), without their dependencies."""
    if not specs:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest), *(a for p in PLATFORMS for a in ("--platform", p)),
           *specs]
    subprocess.run(cmd, check=True)


def pack(dists: list[Dist], out: Path) -> int:
    """The dists' pure files in one ``tar.xz``, paths relative to their folder; bytes before packing."""
    raw = 0
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for dist in dists:
            for f in dist.pure_files():
                tar.add(dist.folder / f, arcname=str(f), recursive=False)
                raw += (dist.folder / f).stat().st_size
    return raw


def tree(out: Path) -> None:
    """The committed code (``git archive HEAD``), without the results and docs the runs do not read."""
    paths = ["megamoe_convert", "benchmarks/*.py", "benchmarks/*.sh", "tests", "pyproject.toml"]
    subprocess.run(["git", "archive", "--format=tar", "-o", str(out), "HEAD", "--", *paths], cwd=REPO, check=True)


def working_tree_bytes() -> int:
    """What the device call sends besides ``.device/``: tracked and untracked, not ignored, files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def build(engines: list[str], out: Path, load_formats: bool, with_tree: bool) -> dict:
    from engine_envs import ensure

    shutil.rmtree(out, ignore_errors=True)
    (out / "whl").mkdir(parents=True)
    venv = Path(sysconfig.get_paths()["purelib"])
    site: dict[str, Dist] = {}
    wheels: dict[str, str] = {}
    contents: dict = {"engines": {}, "site": {}, "wheels": []}
    for engine in engines:
        layers = ensure(engine)
        modules = trace(engine, layers)
        dists = select([*layers, venv], modules)
        own = [d for d in dists if d.folder == layers[0]]
        name = f"{engine.replace('==', '-')}.tar.xz"
        raw = pack(own, out / name)
        contents["engines"][engine] = {"file": name, "unpack_to": TARGETS.get(engine), "raw_bytes": raw,
                                       "dists": {d.name: d.version for d in own}}
        for dist in dists:
            if dist.folder == layers[0]:
                continue
            pin = f"{dist.name}=={dist.version}"
            if needs_wheel(dist, modules):
                wheels[dist.name] = pin
            elif site.setdefault(dist.name, dist).version != dist.version:
                raise SystemExit(f"{dist.name}: {site[dist.name].version} and {dist.version} both chosen")
    for name in wheels:
        site.pop(name, None)
    contents["site"] = {"file": "site.tar.xz", "unpack_to": "/tmp/site", "raw_bytes": pack(list(site.values()),
                                                                                            out / "site.tar.xz"),
                        "dists": {d.name: d.version for d in site.values()}}
    pins = sorted(wheels.values()) + (LOAD_FORMATS if load_formats else [])
    download(pins, out / "whl")
    contents["wheels"] = pins
    if with_tree:
        tree(out / "tree.tar")
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    contents["bytes"] = {"files": files, "carry": sum(files.values()), "working_tree": working_tree_bytes()}
    (out / "contents.json").write_text(json.dumps(contents, indent=1) + "\n")
    return contents


def report(contents: dict) -> None:
    sizes = contents["bytes"]
    for name, n in sizes["files"].items():
        print(f"{n / 2**20:8.2f} MiB  {name}")
    total = sizes["carry"] + sizes["working_tree"]
    print(f"{sizes['carry'] / 2**20:8.2f} MiB  .device/ in all; with the working tree "
          f"({sizes['working_tree'] / 2**20:.2f} MiB) {total / 2**20:.2f} MiB of the "
          f"{CARRY_LIMIT >> 20} MiB a call carries")
    if total > CARRY_LIMIT:
        raise SystemExit("too large for one call: carry fewer engines")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="vllm==0.33.0",
                   help=f"comma-separated, of {', '.join(TARGETS)} (start-up's baselines need vllm==0.32.0 too)")
    p.add_argument("--load-formats", action="store_true",
                   help="add wheels of vLLM's other load formats (bench_node.py's fastsafetensors, instanttensor, "
                        "runai_streamer)")
    p.add_argument("--no-tree", action="store_true", help="leave out tree.tar (the device runs the working tree)")
    p.add_argument("--out", type=Path, default=REPO / ".device")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in TARGETS]
    if unknown:
        p.error(f"unknown engine(s) {unknown}: choose from {', '.join(TARGETS)}")
    contents = build(engines, args.out, args.load_formats, not args.no_tree)
    report(contents)
    return contents


if __name__ == "__main__":
    main()
