"""The presets ``synth`` writes: each a ``config.json`` of ``configs/``, read with no torch, so that the
command line can list them in ``megamoe synth -h`` without importing it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megamoe_convert import jsonio

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
#: DeepSeek-V4 (tiny, and the published Flash / Pro dims), DeepSeek-V4.1 (v4.1-flash: the published
#: V4.1-Flash dims), Kimi-K3, DeepSeek-V3, Qwen3-MoE (Qwen3-235B-A22B) and GLM-4.5 (the published dims):
#: see README "Presets".
PRESETS = ("tiny", "flash", "pro", "v4.1-tiny", "v4.1-flash", "kimi-k3-tiny", "kimi-k3", "deepseek-v3-tiny",
           "deepseek-v3", "qwen3-moe-tiny", "qwen3-moe", "glm-4.5-tiny", "glm-4.5")


def load_preset(name: str) -> dict[str, Any]:
    """A preset's ``config.json`` fields, from ``configs/{name}.json`` (or a path to a JSON file)."""
    path = Path(name) if name.endswith(".json") else CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}: no {path} (presets: {', '.join(PRESETS)})")
    return jsonio.read(path, ValueError, "preset", jsonio.MAX_CONFIG_BYTES)
