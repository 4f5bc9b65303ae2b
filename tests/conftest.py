"""Shared fixtures: real checkpoints on disk, and real CLI runs (``cli_runs``): in the pytest process
(``run_cli``, the unit tier) or in a process of their own (``run_cli_process``, the e2e tier)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cli_runs import run_cli, run_cli_process

from megamoe_convert.synth.write import synthesize

__all__ = ["REPO", "disk_folder", "drop_from_page_cache", "nowait_supported", "output_files", "run_cli",
           "run_cli_process"]

REPO = Path(__file__).resolve().parent.parent
#: The damage fixtures (sources of three kinds and their conversions), for every tier.
pytest_plugins = ["damage"]
#: tests/engines runs only inside an engine's environment (tests/test_engines_real.py).
collect_ignore = [] if os.environ.get("MEGAMOE_ENGINE") else ["engines"]
#: The tiers: each a folder of tests/ and the marker its tests carry (registered in pyproject.toml).
TIERS = ("unit", "e2e", "engines")
#: The driver that runs tests/engines inside each engine's environment: the engines tier too.
ENGINE_DRIVER = "test_engines_real.py"
#: The tiers by what one test costs: an engine's whole suite, a process of its own, a call.
SLOWEST_FIRST = ("engines", "e2e", "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier, read from its folder, so `-m` selects a tier wherever it runs from;
    then order the tiers slowest first (tests/engines' runs, real processes, in-process), so that
    parallel workers (`make test`: pytest-xdist) start the long tests first and end together."""
    for item in items:
        path = item.path.relative_to(REPO / "tests")
        tier = path.parts[0] if path.parts[0] in TIERS else "engines" if path.name == ENGINE_DRIVER else None
        if tier is None:
            raise pytest.UsageError(f"{path}: a test outside the tier folders tests/{{unit,e2e,engines}}")
        item.add_marker(tier)
    items.sort(key=lambda item: SLOWEST_FIRST.index(next(m for m in SLOWEST_FIRST if item.get_closest_marker(m))))


@pytest.fixture(autouse=True)
def _unit_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test runs in the pytest process: one that starts a process of its own (seconds of
    interpreter start and imports each) belongs in tests/e2e, and fails here saying so."""
    if request.node.get_closest_marker("unit"):
        monkeypatch.setattr(subprocess.Popen, "_execute_child", _no_process)


def _no_process(self: subprocess.Popen, args: object, *rest: object) -> None:
    raise AssertionError(f"a unit test started a process ({args}): it belongs in tests/e2e")


def output_files(out: Path) -> dict[str, bytes]:
    """Every file of a converted directory, by relative path, except the hidden conversion state."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".megamoe" not in p.relative_to(out).parts}


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (H=256, I=128, 8 experts, 2 layers + 1 MTP), int8 weights. Read-only."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    synthesize(path, "tiny", seed=1)
    return path


@pytest.fixture(scope="session")
def tiny_converted(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_ckpt`` converted through the CLI for EP 4 with 4 redundant experts. Read-only."""
    out = tmp_path_factory.mktemp("converted") / "ep4"
    run_cli("convert", tiny_ckpt, out, "--ep-size", 4, "--num-redundant-experts", 4)
    return out


def disk_folder(tmp_path: Path) -> Path:
    """``tmp_path``, or where that is on tmpfs (which has no disk to drop pages to) a folder under the
    checkout's ignored ``.cache``: files here can be dropped from the page cache."""
    import tempfile

    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    mount = max((m for m in mounts if str(tmp_path).startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]))
    if mount[2] != "tmpfs":
        return tmp_path
    cache = REPO / ".cache"
    cache.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(dir=cache))


def drop_from_page_cache(path: Path) -> None:
    """``path``'s pages out of the page cache (made clean first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def nowait_supported(path: Path) -> bool:
    """Whether ``path``'s file system answers a read that may not wait (``RWF_NOWAIT``) at all."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
