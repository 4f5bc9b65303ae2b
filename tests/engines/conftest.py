"""Tests that run a real engine's code (fixtures: ``tests/conftest.py``). They run only inside that engine's environment
(``tests/test_engines_real.py`` builds it and runs this folder there); there a missing or
wrong engine is a failure, never a skip."""

from __future__ import annotations

import os

import pytest

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

