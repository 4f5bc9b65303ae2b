"""Tests that run a real engine's code. They run only inside that engine's environment
(``tests/test_engines_real.py`` builds it and runs this folder there); there a missing or
wrong engine is a failure, never a skip."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_runs import run_cli
from filelock import FileLock

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


#: A folder the driver (tests/test_engines_real.py) hands every engine's run: the checkpoints and
#: conversions below are built by the first run that needs them and read by the later ones, since
#: megamoe-convert's own code writes the same bytes whatever engine is installed beside it.
SHARED = os.environ.get("MEGAMOE_ENGINE_SHARED")


def built(folder: str, name: str, tmp_path_factory: pytest.TempPathFactory, build: Callable[[Path], object],
          ) -> Path:
    """``<folder>/<name>``, made by ``build(path)``: once for every engine's run in the shared folder
    (a build left half-done by an earlier run is made again; runs at once wait for the first), else in
    a folder of this run's own."""
    if not SHARED:
        path = tmp_path_factory.mktemp(folder) / name
        build(path)
        return path
    path = Path(SHARED) / folder / name
    done = path.with_name(f"{name}.done")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_name(f"{name}.lock")):  # engines' runs side by side build it once
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path


def run_convert(src: Path, *args: object) -> Callable[[Path], object]:
    """A build that converts ``src`` into its path through the real command line (its entry, in this
    process: ``tests/cli_runs.py``)."""
    return lambda out: run_cli("convert", src, out, *args)


def synthesized(preset: dict, seed: int) -> Callable[[Path], object]:
    """A build that synthesises a checkpoint of ``preset`` (a preset's fields) into its path."""
    def build(path: Path) -> None:
        (path.parent / f"{path.name}.preset.json").write_text(json.dumps(preset))
        synthesize(path, str(path.parent / f"{path.name}.preset.json"), seed=seed)
    return build


@pytest.fixture(scope="session")
def engine_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with I = 512: a multiple of 512, as every released DeepSeek-V4 is (vLLM
    0.30 pads other sizes in finalize)."""
    return built("engine-ckpt", "ckpt", tmp_path_factory,
                 synthesized({**load_preset("tiny"), "moe_intermediate_size": 512}, seed=5))


@pytest.fixture(scope="session")
def engine_converted(engine_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """EP 4 with 4 redundant experts: 3 slots per rank, ranks 1-3 hold replicas."""
    return built("engine-out", "ep4", tmp_path_factory,
                 run_convert(engine_ckpt, "--ep-size", 4, "--num-redundant-experts", 4))


@pytest.fixture(scope="session")
def engine_experts_only(engine_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built("engine-out", "experts-only", tmp_path_factory,
                 run_convert(engine_ckpt, "--ep-size", 4, "--num-redundant-experts", 4, "--experts-only"))


@pytest.fixture(scope="session")
def sglang_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with hidden_size 512 (SGLang's MegaMoE needs hidden % 512 == 0). Read-only."""
    import sglang_harness

    return built("ckpt", "tiny-h512", tmp_path_factory, synthesized(sglang_harness.CONFIG, seed=2))


@pytest.fixture(scope="session")
def sglang_converted(sglang_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sglang_ckpt`` converted for SGLang, EP 4 with 4 redundant experts. Read-only."""
    options = ConvertOptions(ep_size=4, num_redundant_experts=4, engine="sglang")
    return built("converted", "sglang-ep4", tmp_path_factory, lambda out: convert(sglang_ckpt, out, options))


@pytest.fixture(scope="session")
def engine_store(engine_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``engine_ckpt`` as a store (no --ep-size): every logical expert once, for any EP size."""
    return built("engine-out", "store", tmp_path_factory, run_convert(engine_ckpt))


@pytest.fixture(scope="session")
def sglang_store(sglang_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sglang_ckpt`` as a store: the same files serve SGLang's placement (and vLLM's)."""
    return built("converted", "sglang-store", tmp_path_factory, run_convert(sglang_ckpt))


@pytest.fixture
def probes_afresh() -> Iterator[None]:
    """No layout probe passed before the test, nor after it: each test's install probes the engine again
    (and no watch for a model's first MoE block outlives the test)."""
    from megamoe_convert.engines import early_probe, probe

    probe.forget()
    yield
    early_probe.stop()
    probe.forget()
