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
(downloaded with pip), or as installed where that extension is built for any Python 3 (abi3);
compiled extensions nobody imported are dropped. What the device's Python already has (torch and
what it needs, safetensors, tokenizers) is not carried. ``--check PYTHON`` then tries the folder.

    .device/vllm-0.33.0.tar.xz   the engine's own folder (vLLM and its transformers): /tmp/v33 there
    .device/site.tar.xz          the import chains' and the project's pure-Python needs: /tmp/site
    .device/whl/*.whl            cp312 wheels of the compiled ones (and --load-formats'): into /tmp/site
    .device/tree.tar             ``git archive HEAD`` of the code (the committed tree): /tmp/tree
    .device/contents.json        what was chosen, and the sizes

    python benchmarks/device_carry.py --load-formats                        # device_node.sh
    python benchmarks/device_carry.py --engines vllm==0.33.0,vllm==0.32.0   # device_startup.sh
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(REPO / "tests"))

#: What a call may carry in all (the working tree counts too).
CARRY_LIMIT = 64 << 20
#: Distributions the device's Python has: torch with what it needs, and safetensors, tokenizers and
#: sentencepiece in versions the engines accept (transformers checks them at import); the project's own
#: code travels as the working tree (or tree.tar).
DEVICE_HAS = {"torch", "numpy", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock",
              "fsspec", "typing-extensions", "setuptools", "safetensors", "tokenizers", "sentencepiece",
              "megamoe-convert"}
#: vLLM's load formats beside `auto` (vLLM 0.33 asks fastsafetensors>=0.3.3, instanttensor>=0.2.2,
#: runai-model-streamer>=0.15.7, which needs humanize), and compressed-tensors (vLLM 0.33's pin) with its
#: loguru, which vLLM's quantization methods import on the CUDA platform alone: wheels only.
LOAD_FORMATS = ["fastsafetensors==0.5.0", "instanttensor==0.2.2", "runai-model-streamer==0.17.0", "humanize==4.17.0",
                "compressed-tensors==0.17.0", "loguru==0.7.3"]
#: Where each engine's own folder unpacks on the device (the device scripts' paths).
TARGETS = {"vllm==0.33.0": "/tmp/v33", "vllm==0.32.0": "/tmp/v32", "sglang==0.5.23": "/tmp/sglang"}
#: Files that no import reads: by suffix, and by folder name.
SKIP_SUFFIXES = (".pyc", ".pyi", ".h", ".hpp", ".cuh", ".cu", ".c", ".cc", ".cpp", ".cxx", ".inl", ".a", ".js",
                 ".css", ".html", ".map", ".svg", ".png", ".jpg", ".ico", ".woff", ".woff2", ".ttf", ".md",
                 ".rst", ".so", ".pyd", ".dll", ".dylib", ".exe")
SKIP_DIRS = {"__pycache__", "tests", "test", "bin", "include"}
SKIP_META = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
#: Folders kept whole, sources of other languages included: an engine's JIT kernels, compiled on the
#: device at first use (SGLang finds its JIT package by these folders at import).
KEEP_WHOLE = ("sglang/kernels/jit/",)
#: The device's glibc takes any of these (pip matches each tag exactly).
PLATFORMS = [*(f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)), "manylinux2014_x86_64", "manylinux1_x86_64"]

#: Written as sitecustomize.py into the traced process's path: each module name loaded, as it loads,
#: and at exit the real path of every shared object mapped into the process (extension modules, and
#: a package's own libraries loaded by hand: xgrammar's bindings, say).
TRACER = """
import atexit, os, sys
_out = open(os.environ["MEGAMOE_TRACE_FILE"], "a")
_seen = set(sys.modules)
_out.write("\\n".join(_seen) + "\\n")
def _hook(event, args):
    if event == "import" and args[0] not in _seen:
        _seen.add(args[0])
        _out.write(args[0] + "\\n")
        _out.flush()
def _mapped():
    with open("/proc/self/maps") as maps:
        paths = {line.split()[5] for line in maps if len(line.split()) >= 6 and ".so" in line.split()[5]}
    _out.write("".join(os.path.realpath(p) + "\\n" for p in sorted(paths)))
    _out.flush()
sys.addaudithook(_hook)
atexit.register(_mapped)
"""
IMPORTS = re.compile(r"^\s*(?:from|import)\s+((?:vllm|sglang)(?:\.\w+)*)", re.M)


# --------------------------------------------------------------------------------------
# What the benchmarks import
# --------------------------------------------------------------------------------------

def engine_modules(engine: str) -> list[str]:
    """The engine's harnesses (``tests/engines/vllm*harness*.py``: SGLang's stands in for torchvision,
    which the device has), then every ``vllm.*`` (or ``sglang.*``) module that the benchmarks, the
    harnesses and the project's engine code import, found in their source."""
    package = engine.split("==")[0]
    harnesses = sorted((REPO / "tests" / "engines").glob(f"{package}*harness*.py"),
                       key=lambda p: (p.stem != f"{package}_harness", p.stem))  # the base harness first
    sources = [*BENCH.glob("*.py"), *(REPO / "tests" / "engines").glob("*harness*.py"),
               *(REPO / "megamoe_convert" / "engines").rglob("*.py")]
    found = {m for path in sources for m in IMPORTS.findall(path.read_text()) if m.split(".")[0] == package}
    return [p.stem for p in harnesses] + sorted(found)


#: Imports every module of megamoe_convert and the engine modules named on its command line; prints
#: one line for each that does not import.
IMPORT_ALL = ("import importlib, pkgutil, sys\nimport megamoe_convert\n"
              "names = [m.name for m in pkgutil.walk_packages(megamoe_convert.__path__, 'megamoe_convert.')\n"
              "         if not m.name.endswith('__main__')]\n"
              "for name in names + sys.argv[1:]:\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except Exception as exc:\n"
              "        print('not imported:', name, type(exc).__name__, (str(exc).splitlines() or [''])[0][:200])\n")


def import_all(python: str, engine: str, path: list[Path], code: Path, env: dict[str, str] | None = None,
               ) -> tuple[int, list[str], str]:
    """Run :data:`IMPORT_ALL` with ``python`` on ``path`` and the code in ``code``, on the CPU platform (as
    the device scripts run vLLM): its exit code, the modules that did not import, its error output."""
    entries = [*map(str, path), str(code), str(code / "benchmarks"), str(code / "tests" / "engines")]
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(entries), "VLLM_TARGET_DEVICE": "cpu",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([python, "-c", IMPORT_ALL, *engine_modules(engine)], env=env, cwd=code,
                          capture_output=True, text=True, timeout=1800)
    failed = [line.removeprefix("not imported: ") for line in proc.stdout.splitlines()
              if line.startswith("not imported: ")]
    return proc.returncode, failed, proc.stdout[-3000:] + proc.stderr[-3000:]


def trace(engine: str, layers: list[Path]) -> tuple[set[str], list[str]]:
    """The modules loaded by :data:`IMPORT_ALL` on the engine's environment here, and those that failed."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(TRACER)
        log = Path(tmp, "modules.txt")
        code, failed, out = import_all(sys.executable, engine, [Path(tmp), *layers], REPO,
                                       {"MEGAMOE_TRACE_FILE": str(log)})
        if code != 0:
            raise SystemExit(f"tracing {engine}'s imports failed:\n{out}")
        return set(log.read_text().split()), failed


def check(out: Path, python: str) -> list[str]:
    """Unpack ``out`` as the device scripts do and run :data:`IMPORT_ALL` with ``python`` (one with what the
    device's Python has, nothing more, for the Python the wheels were fetched for): what fails there
    that imported here."""
    contents = json.loads((out / "contents.json").read_text())
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in [info["file"] for info in contents["engines"].values()] + ["site.tar.xz"]:
            with tarfile.open(out / name) as tar:
                tar.extractall(root / name.removesuffix(".tar.xz"), filter="data")
        wheels = sorted(map(str, (out / "whl").glob("*.whl")))
        if wheels:
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--target", str(root / "site"), *wheels], check=True)
        code = REPO
        if (out / "tree.tar").exists():
            with tarfile.open(out / "tree.tar") as tar:
                tar.extractall(root / "tree", filter="data")
            code = root / "tree"
        for engine, info in contents["engines"].items():
            path = [root / "site", root / info["file"].removesuffix(".tar.xz")]
            status, failed, output = import_all(python, engine, path, code)
            here = {line.split()[0] for line in info["not_imported_here"]}
            problems += [f"{engine}: {line}" for line in failed if line.split()[0] not in here]
            problems += [f"{engine}: exit {status}\n{output}"] if status else []
    return problems


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

    def loaded(self, modules: set[str]) -> list[Path]:
        """Its native files the trace saw load: extension modules imported (by name), shared objects
        mapped into the process (by real path)."""
        found = [f for name, f in self.extensions().items() if name in modules]
        return found + [f for f in self.files if ".so" in f.name and f not in found
                        and os.path.realpath(self.folder / f) in modules]

    def carried(self, modules: set[str]) -> list[Path]:
        """:meth:`pure_files`, and where a native file of it loaded, its native files that no one Python
        version is built into (abi3 extensions, its own libraries) with the libraries they link."""
        if not self.loaded(modules):
            return self.pure_files()
        native = [f for f in self.files if (f.suffix == ".so" or ".so." in f.name or f.parts[0].endswith(".libs"))
                  and ".cpython-" not in f.name]
        return self.pure_files() + [f for f in native if (self.folder / f).is_file()]

    def pure_files(self) -> list[Path]:
        """The files that travel as they are: sources, data and metadata."""
        keep = []
        for f in self.files:
            meta = f.parts[0].endswith(".dist-info")
            if f.as_posix().startswith(KEEP_WHOLE) and f.suffix not in (".pyc", ".so"):
                pass
            elif meta and f.name in SKIP_META or not meta and (f.suffix in SKIP_SUFFIXES or ".so." in f.name
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
    """Whether a native file of ``dist`` that loaded is built for this Python alone (a ``cpython-3XX``
    extension, not abi3): then its wheel for the device's Python travels instead."""
    return any(".cpython-" in f.name for f in dist.loaded(modules))


# --------------------------------------------------------------------------------------
# Building .device/
# --------------------------------------------------------------------------------------

def download(specs: list[str], dest: Path, python: str = "3.12") -> None:
    """manylinux wheels of ``specs`` (exact pins) for ``python``, without their dependencies."""
    if not specs:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-qq", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", str(dest), *(a for p in PLATFORMS for a in ("--platform", p)),
           *specs]
    subprocess.run(cmd, check=True)


def pack(dists: list[Dist], out: Path, modules: set[str] | None = None) -> int:
    """The dists' files in one ``tar.xz``, paths relative to their folder: the pure ones, and with
    ``modules`` (what the trace loaded) the abi3 extensions it loaded; bytes before packing."""
    raw = 0
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for dist in dists:
            for f in (dist.carried(modules) if modules is not None else dist.pure_files()):
                tar.add(dist.folder / f, arcname=str(f), recursive=False)
                raw += (dist.folder / f).stat().st_size
    return raw


def tree(out: Path) -> None:
    """The committed code (``git archive HEAD``), without the results and docs the runs do not read, and
    the package's entry points (a ``dist-info`` beside it), so that the engines find its plugins when the
    tree is on ``sys.path``, as they do where megamoe-convert is installed."""
    paths = ["megamoe_convert", "benchmarks/*.py", "benchmarks/*.sh", "tests", "configs", "pyproject.toml"]
    subprocess.run(["git", "archive", "--format=tar", "-o", str(out), "HEAD", "--", *paths], cwd=REPO, check=True)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    entry_points = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n"
                           for group, points in project.get("entry-points", {}).items())
    files = {"METADATA": f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n",
             "entry_points.txt": entry_points}
    with tarfile.open(out, "a") as tar:
        for name, text in files.items():
            data = text.encode()
            member = tarfile.TarInfo(f"{info}/{name}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def working_tree_bytes() -> int:
    """What the device call sends besides ``.device/``: tracked and untracked, not ignored, files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


class Choice:
    """What travels: each engine's own folder's dists, the shared ones (pure, or as wheels), and every
    module the traces loaded."""

    def __init__(self) -> None:
        self.own: dict[str, list[Dist]] = {}
        self.site: dict[str, Dist] = {}
        self.wheels: dict[str, str] = {}
        self.modules: set[str] = set()
        self.failed: dict[str, list[str]] = {}


def choose(engines: list[str]) -> Choice:
    from engine_envs import ensure

    venv = Path(sysconfig.get_paths()["purelib"])
    choice = Choice()
    for engine in engines:
        layers = ensure(engine)
        modules, choice.failed[engine] = trace(engine, layers)
        choice.modules |= modules
        dists = select([*layers, venv], modules)
        choice.own[engine] = [d for d in dists if d.folder == layers[0]]
        for dist in (d for d in dists if d.folder != layers[0]):
            if needs_wheel(dist, modules):
                choice.wheels[dist.name] = f"{dist.name}=={dist.version}"
            elif choice.site.setdefault(dist.name, dist).version != dist.version:
                raise SystemExit(f"{dist.name}: {choice.site[dist.name].version} and {dist.version} both chosen")
    for name in choice.wheels:
        choice.site.pop(name, None)
    return choice


def build(engines: list[str], out: Path, load_formats: bool, with_tree: bool, python: str = "3.12") -> dict:
    choice = choose(engines)
    shutil.rmtree(out, ignore_errors=True)
    (out / "whl").mkdir(parents=True)
    pins = sorted(choice.wheels.values()) + (LOAD_FORMATS if load_formats else [])
    download(pins, out / "whl", python)  # first: a pin with no wheel stops the build before the packing
    contents: dict = {"engines": {}, "wheels": pins}
    for engine, own in choice.own.items():
        name = f"{engine.replace('==', '-')}.tar.xz"
        contents["engines"][engine] = {"file": name, "unpack_to": TARGETS[engine], "raw_bytes": pack(own, out / name),
                                       "dists": {d.name: d.version for d in own},
                                       "not_imported_here": choice.failed[engine]}
    site = sorted(choice.site.values(), key=lambda d: d.name)
    contents["site"] = {"file": "site.tar.xz", "unpack_to": "/tmp/site", "dists": {d.name: d.version for d in site},
                        "raw_bytes": pack(site, out / "site.tar.xz", choice.modules)}
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
    p.add_argument("--check", metavar="PYTHON", help="then unpack the folder as the device does and import "
                   "what the benchmarks import with PYTHON (one with torch and no more), saying what fails")
    p.add_argument("--python", default="3.12", help="the device's Python, for the wheels (another lets a machine "
                                                    "of that Python try the folder)")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in TARGETS]
    if unknown:
        p.error(f"unknown engine(s) {unknown}: choose from {', '.join(TARGETS)}")
    contents = build(engines, args.out, args.load_formats, not args.no_tree, args.python)
    report(contents)
    if args.check:
        problems = check(args.out, args.check)
        print("\n".join(problems) or f"every module that imported here imports with {args.check} from {args.out}")
        if problems:
            raise SystemExit(1)
    return contents


if __name__ == "__main__":
    main()
