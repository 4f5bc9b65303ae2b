"""Tests that run a real engine's code (fixtures: ``tests/conftest.py``). They run only inside that engine's environment
(``tests/test_engines_real.py`` builds it and runs this folder there); there a missing or
wrong engine is a failure, never a skip."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megamoe_convert.convert import ConvertOptions, convert
from megamoe_convert.synth import synthesize

EXPECTED = os.environ.get("MEGAMOE_ENGINE")  # e.g. "vllm==0.33.0"


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("only_kernel_layout: vLLM >= 0.33 only", "only_finalize: vLLM 0.30-0.32 only"):
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
        drop = "only_finalize" if vllm_harness.KERNEL_LAYOUT else "only_kernel_layout"
        keep = [item for item in keep if item.get_closest_marker(drop) is None]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep



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
