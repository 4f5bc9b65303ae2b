"""The engine's environment WITHOUT megamoe-convert: what a serving image that never installed it
runs. The test venv has megamoe-convert installed (its entry points included), so a bare run
uses a copy of its site-packages as symlinks minus megamoe-convert's files, the engine's own
folders, and ``python -S`` (no ``.pth`` processing: the editable install's finder never runs).
The script it runs first proves the project is absent: no import, no entry point."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROVE_BARE = """
import importlib.metadata, importlib.util
assert importlib.util.find_spec("megamoe_convert") is None, "megamoe_convert is importable"
groups = ("vllm.general_plugins", "sglang.srt.plugins")
found = [e for g in groups for e in importlib.metadata.entry_points(group=g) if "megamoe" in e.value]
assert not found, f"megamoe entry points visible: {found}"
"""


def site_without_project(root: Path) -> Path:
    """``root/site``: the venv's site-packages as symlinks, megamoe-convert's files left out."""
    farm = root / "site"
    if farm.is_dir():
        return farm
    farm.mkdir(parents=True)
    for packages in site.getsitepackages():
        for entry in Path(packages).iterdir():
            name = entry.name.lower()
            if "megamoe" in name or (farm / entry.name).exists():
                continue
            (farm / entry.name).symlink_to(entry)
    return farm


def run_bare(script: str, root: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in the engine's environment without megamoe-convert (see the module docstring)."""
    engine_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if p and Path(p).resolve() != REPO and not (Path(p) / "megamoe_convert").exists()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*engine_paths, str(site_without_project(root))])}
    return subprocess.run([sys.executable, "-S", "-c", PROVE_BARE + script], env=env, cwd=root, text=True,
                          capture_output=True, timeout=timeout)
