"""Environments that hold a real engine release beside the project's own venv.

An engine's wheel (hundreds of MB, with CUDA libraries) is installed ``--no-deps`` into a
folder of its own under the engine cache (:data:`CACHE`), and the packages its import chain needs into
another, shared by every release that needs the same ones; the project's torch is reused, so
nothing multi-GB is pulled. Each folder is named by a hash of its package list (a changed list
builds a new one), built once and put in place by a rename, so a half-built one is never used.
Tests run the engine's own code in a subprocess with ``PYTHONPATH=<folders>``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parent.parent


def cache_folder() -> Path:
    """Where the environments live: ``MEGAMOE_ENGINE_CACHE``, else the user's cache folder
    (``${XDG_CACHE_HOME:-~/.cache}/megamoe-convert/engines``), outside any clone, so that every clone
    of the repository on a machine (CI's fresh ones included) builds them once."""
    if os.environ.get("MEGAMOE_ENGINE_CACHE"):
        return Path(os.environ["MEGAMOE_ENGINE_CACHE"])
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return user_cache / "megamoe-convert" / "engines"


CACHE = cache_folder()

#: What vLLM's loading code imports, beyond what the project's venv already has
#: (torch, safetensors, numpy, huggingface_hub, filelock, psutil, ...): found by importing
#: vllm.models.deepseek_v4, the fused-MoE layers and the model loader on a CPU.
VLLM_IMPORT_CHAIN = [
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "apache-tvm-ffi==0.1.11", "attrs==26.1.0",
    "cachetools==8.0.1", "cbor2==6.3.0", "certifi==2026.10.18", "cloudpickle==3.1.2", "einops==0.8.2",
    "fastapi==0.136.0", "frozenlist==1.8.0", "llguidance==1.9.1", "msgspec==0.22.0", "multidict==7.2.1",
    "openai==3.54.0", "openai-harmony==0.0.8", "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0",
    "prometheus-client==0.26.0", "propcache==0.5.4", "py-cpuinfo==9.0.0", "pybase64==1.5.1", "pyzmq==27.3.0",
    "regex==2026.11.15", "requests==2.34.2", "sniffio==1.3.1", "starlette==1.10.0", "tokenizers==0.23.3",
    "urllib3==2.8.0", "uvloop==0.23.0", "xgrammar==0.2.8", "yarl==1.25.1",
]

#: What SGLang's loading code imports (found the same way: sglang.srt's MoE layers, fp8.py, mega_moe.py,
#: the DeepSeek-V4 models, the model loader, plugins and server args). triton is imported at the top
#: of sglang.srt.utils; torchvision is not installable for a CPU torch (tests/engines/sglang_harness.py).
SGLANG_IMPORT_CHAIN = [
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "apache-tvm-ffi==0.1.11", "attrs==26.1.0",
    "certifi==2026.10.18", "charset-normalizer==3.5.2", "compressed-tensors==0.20.0", "dill==0.4.1",
    "einops==0.8.2", "frozenlist==1.8.0", "gguf==0.19.0", "ipython==9.18.1", "loguru==0.7.3", "msgspec==0.22.0",
    "multidict==7.2.1", "openai==3.54.0", "orjson==3.13.0", "partial-json-parser==0.2.1.1.post7",
    "pillow==13.0.0", "propcache==0.5.4", "pybase64==1.5.1", "pyzmq==27.3.0", "regex==2026.11.15",
    "requests==2.34.2", "sentencepiece==0.2.3", "sniffio==1.3.1", "starlette==1.10.0", "tokenizers==0.23.3",
    "traitlets==5.16.1", "triton==3.9.0", "urllib3==2.8.0", "yarl==1.25.1",
]

#: vLLM 0.33's Kimi-K3 model imports compressed-tensors (its checkpoint's quantization format) and
#: that imports loguru: the pins SGLang's chain uses, in a small layer of their own.
VLLM_KIMI_K3_LAYER: tuple[str, list[str]] = ("vllm-kimi-k3", ["compressed-tensors==0.20.0", "loguru==0.7.3"])

#: transformers < 5.18 (what vLLM 0.30-0.31 pin) wants huggingface_hub 1.x, which speaks httpx.
HUB_1X = ["huggingface-hub==1.33.0", "httpx==0.28.1", "httpcore==1.0.9"]

#: A folder of packages: (name, pins).
Layer = tuple[str, list[str]]

VLLM_CHAIN_LAYER: Layer = ("vllm-import-chain", VLLM_IMPORT_CHAIN)
SGLANG_CHAIN_LAYER: Layer = ("sglang-import-chain", SGLANG_IMPORT_CHAIN)

#: Each engine: its package layers, first on the path first.
ENGINES: dict[str, list[Layer]] = {
    "vllm==0.30.0": [("vllm-0.30.0", ["vllm==0.30.0", "transformers==5.17.0", *HUB_1X]), VLLM_CHAIN_LAYER],
    "vllm==0.31.0": [("vllm-0.31.0", ["vllm==0.31.0", "transformers==5.17.0", *HUB_1X]), VLLM_CHAIN_LAYER],
    "vllm==0.32.0": [("vllm-0.32.0", ["vllm==0.32.0", "transformers==5.19.0"]), VLLM_CHAIN_LAYER],
    "vllm==0.33.0": [("vllm-0.33.0", ["vllm==0.33.0", "transformers==5.20.0"]), VLLM_CHAIN_LAYER,
                     VLLM_KIMI_K3_LAYER],
    "sglang==0.5.23": [("sglang-0.5.23", ["sglang==0.5.23", "transformers==5.19.0"]), SGLANG_CHAIN_LAYER],
}


def layer_dir(layer: Layer) -> Path:
    """``<engine cache>/<name>-<hash of the pins>``."""
    name, packages = layer
    return CACHE / f"{name}-{hashlib.sha256(chr(10).join(packages).encode()).hexdigest()[:12]}"


def ensure_layer(layer: Layer) -> Path:
    """One folder of the layer's packages, installed ``--no-deps``, built if missing."""
    packages = layer[1]
    target = layer_dir(layer)
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not target.is_dir():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--target", str(partial), *packages]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"installing {' '.join(packages)} failed:\n{proc.stdout}\n{proc.stderr}")
            partial.rename(target)
        compile_once(target)
        return target


def compile_once(target: Path) -> None:
    """Byte-compile a layer in place, once (a stamp records it): every test process then imports the
    engine from bytecode, even where ``PYTHONDONTWRITEBYTECODE`` keeps Python from caching what it
    compiles (an engine's import compiles thousands of modules otherwise, in every process)."""
    stamp = target / ".megamoe-compiled"
    if stamp.exists():
        return
    # -q: a layer's stray files of other Python versions fail to compile; they are never imported
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(target)], capture_output=True)
    stamp.touch()


def ensure(engine: str) -> list[Path]:
    """The folders that make ``engine``'s environment (e.g. ``vllm==0.33.0``), built if missing."""
    return [ensure_layer(layer) for layer in ENGINES[engine]]


def run_engine_tests(engine: str, *args: str, timeout: float = 1800, shared: Path | None = None,
                     ) -> subprocess.CompletedProcess[str]:
    """``pytest tests/engines`` inside ``engine``'s environment, on the CPU; ``shared``: a folder where
    the checkpoints and conversions the engines' tests read are built once for several runs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, ensure(engine)), str(REPO)]),
           "MEGAMOE_ENGINE": engine, "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
           **({"MEGAMOE_ENGINE_SHARED": str(shared)} if shared else {})}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(REPO / "tests" / "engines"),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


if __name__ == "__main__":  # python tests/engine_envs.py [ENGINE...]: build (or find) the environments
    for name in sys.argv[1:] or list(ENGINES):
        print(os.pathsep.join(map(str, ensure(name))))
