"""The engines' real code, in CI: each supported release runs ``tests/engines`` in its own
environment (see ``engine_envs.py``). A failure to build the environment, a failing test, a
skipped test or too few tests all fail here: a stand-in passing proves nothing about the engine."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from engine_envs import ENGINES, run_engine_tests

#: Fewest tests each engine's run must pass (catches a collection that silently shrank).
#: 0.33: formats, Kimi-K3, DeepSeek-V4.1 + DSpark, weight cache; model classes: +12 vLLM (+3 on 0.33), +11 SGLang;
#: SGLang's SM90 FP8 MegaMoE (DeepSeek-V3, Qwen3-MoE: install, 16-bit scales, refusals, model classes): +34, and vLLM's
#: refusal of them: +4. The layout probe through each engine's own code: +3 vLLM (0.32: +4, 0.33: +8), +6 SGLang.
#: SGLang's elastic EP (EPLB recovery from a store, its own path, refusals; scale-up joiners; their private names): +14.
#: The load-format matrix: every registered format on a per-rank conversion and a store, its classification and
#: the GPU proof's CPU path: +34 vLLM, +51 SGLang. The non-expert weights through the staging ring (the same tensors
#: as vLLM's own iterator, a hub repo left to it, the two vLLM names it reaches): +4 vLLM.
MIN_PASSED = {"vllm": 85, "sglang": 195, "vllm==0.33.0": 139}


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints and conversions every engine's run reads, built by the first run that needs them:
    one folder for the whole pytest run, its parallel workers (pytest-xdist) included."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's base folder lies in the run's own
    path = root / "engine-shared"
    path.mkdir(exist_ok=True)
    return path


#: vLLM 0.33's suite is the longest: first, so that parallel workers share out the rest beside it.
@pytest.mark.parametrize("engine", sorted(ENGINES, key=lambda engine: engine != "vllm==0.33.0"))
def test_engine_release_real_code(engine: str, shared: Path) -> None:
    proc = run_engine_tests(engine, shared=shared)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{engine}: tests/engines failed:\n{output[-20000:]}"
    summary = output.strip().splitlines()[-1]
    passed = int(m[1]) if (m := re.search(r"(\d+) passed", summary)) else 0
    assert "skipped" not in summary and "xfail" not in summary, f"{engine}: {summary}"
    assert passed >= MIN_PASSED.get(engine, MIN_PASSED[engine.partition("==")[0]]), f"{engine}: {summary}"
