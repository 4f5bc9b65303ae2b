"""Tests that run a real engine's code. They run only inside that engine's environment
(``tests/test_engines_real.py`` builds it and runs this folder there); there a missing or
wrong engine is a failure, never a skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.synth.presets import load_preset
from megamoe_convert.synth.write import synthesize

EXPECTED = os.environ.get("MEGAMOE_ENGINE")  # e.g. "vllm==0.33.0"


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("only_kernel_layout: vLLM >= 0.33 only", "only_finalize: vLLM 0.30-0.32 only",
                   "since_032: vLLM >= 0.32 only (its shared-expert fusion is what install pre-bakes)"):
        config.addinivalue_line("markers", marker)
    if not EXPECTED:
        raise pytest.UsageError("tests/engines runs inside an engine environment: use tests/test_engines_real.py")
    package, _, version = EXPECTED.partition("==")
    module = __import__(package)
    if module.__version__ != version:
        raise pytest.UsageError(f"expected {EXPECTED}, imported {package} {module.__version__} from {module.__file__}")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Another engine's test files are not even imported (their harness imports that engine)."""
    name = collection_path.name
    if name.startswith("test_") and name.endswith(".py"):
        return not name.startswith(f"test_{EXPECTED.partition('==')[0]}_")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test file names its engine, and a test may be for one contract only: the others are
    deselected (never skipped: a skip here is a failure)."""
    package = EXPECTED.partition("==")[0]
    keep = [item for item in items if item.path.name.startswith(f"test_{package}_")]
    if package == "vllm":
        import vllm_harness
        drop = ["only_finalize" if vllm_harness.KERNEL_LAYOUT else "only_kernel_layout"]
        drop += ["since_032"] if vllm_harness.VERSION < (0, 32) else []
        keep = [item for item in keep if not any(item.get_closest_marker(d) for d in drop)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep



def run_convert(src: Path, out: Path, *args: object) -> Path:
    subprocess.run([sys.executable, "-m", "megamoe_convert.cli", "convert", src, out, *map(str, args)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def engine_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with I = 512: a multiple of 512, as every released DeepSeek-V4 is (vLLM
    0.30 pads other sizes in finalize)."""
    root = tmp_path_factory.mktemp("engine-ckpt")
    (root / "preset.json").write_text(json.dumps({**load_preset("tiny"), "moe_intermediate_size": 512}))
    synthesize(root / "ckpt", str(root / "preset.json"), seed=5)
    return root / "ckpt"


@pytest.fixture(scope="session")
def engine_converted(engine_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """EP 4 with 4 redundant experts: 3 slots per rank, ranks 1-3 hold replicas."""
    return run_convert(engine_ckpt, tmp_path_factory.mktemp("engine-out") / "ep4", "--ep-size", 4,
                   "--num-redundant-experts", 4)


@pytest.fixture(scope="session")
def engine_experts_only(engine_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_convert(engine_ckpt, tmp_path_factory.mktemp("engine-out") / "experts-only", "--ep-size", 4,
                   "--num-redundant-experts", 4, "--experts-only")


@pytest.fixture(scope="session")
def sglang_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with hidden_size 512 (SGLang's MegaMoE needs hidden % 512 == 0). Read-only."""
    import sglang_harness

    preset = tmp_path_factory.mktemp("preset") / "tiny-h512.json"
    preset.write_text(json.dumps(sglang_harness.CONFIG))
    path = tmp_path_factory.mktemp("ckpt") / "tiny-h512"
    synthesize(path, str(preset), seed=2)
    return path


@pytest.fixture(scope="session")
def sglang_converted(sglang_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sglang_ckpt`` converted for SGLang, EP 4 with 4 redundant experts. Read-only."""
    out = tmp_path_factory.mktemp("converted") / "sglang-ep4"
    convert(sglang_ckpt, out, ConvertOptions(ep_size=4, num_redundant_experts=4, engine="sglang"))
    return out


@pytest.fixture(scope="session")
def engine_store(engine_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``engine_ckpt`` as a store (no --ep-size): every logical expert once, for any EP size."""
    return run_convert(engine_ckpt, tmp_path_factory.mktemp("engine-out") / "store")


@pytest.fixture(scope="session")
def sglang_store(sglang_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sglang_ckpt`` as a store: the same files serve SGLang's placement (and vLLM's)."""
    return run_convert(sglang_ckpt, tmp_path_factory.mktemp("converted") / "sglang-store")
