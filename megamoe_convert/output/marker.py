"""The converted directory's own guard: ``config.json`` names a marker architecture.

A converted directory's top-level shards hold no routed experts, so an engine that loads it as an
ordinary checkpoint would serve zeros. ``convert`` therefore writes ``OUT/config.json`` with every
``architectures`` entry replaced by a marker name that no engine registers (a bare vLLM or SGLang
refuses it at config time, "Model architectures [...] are not supported", and the name itself says
what to install), and a ``megamoe`` section holding what was replaced. With megamoe-convert
installed in the engine's environment, its plugin puts the original names back while the engine
reads the config and installs each rank's pre-baked experts whichever load format reads the
directory (``engines/vllm_models.py``, ``engines/sglang_models.py``).

The change is exact and deterministic: :func:`mark` of the source's bytes is what ``config.json``
holds (``verify --source`` checks that byte for byte), and :func:`original` gives back the source's
``config.json`` object. ``auto_map`` moves into the section too, so no engine can fall back to a
checkpoint's own remote code for the marker name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

#: The ``config.json`` key of the section (also the attribute engines' config objects carry).
SECTION = "megamoe"
#: What the section names as the tool (a conversion's ``config.json`` is recognised by it).
TOOL = "megamoe-convert"
#: Keys moved from the top level into the section (restored by :func:`original`).
MOVED = ("architectures", "auto_map")
#: What to run, in every marker name and in the section.
INSTALL = "install megamoe-convert into this serving environment"
#: Converted directories recognised without a marker (made before the marker existed).
MANIFEST_NAME = "manifest.json"


class MarkerError(ValueError):
    """A ``config.json`` that cannot be marked, or a marker that does not say what it replaced."""


def marker_name(architecture: str) -> str:
    """The name a bare engine reads in place of ``architecture`` (and prints when it refuses it)."""
    return f"MegaMoE-converted {architecture}: {INSTALL}"


def mark(config_bytes: bytes, where: str = "config.json") -> bytes:
    """The converted directory's ``config.json``: the source's with its architectures replaced by
    marker names and a ``megamoe`` section holding what was moved. Deterministic."""
    try:
        config = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MarkerError(f"{where}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise MarkerError(f"{where}: expected a JSON object, found {type(config).__name__}")
    if SECTION in config:
        raise MarkerError(f"{where}: already has a {SECTION!r} section (a converted directory is not a source)")
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
        raise MarkerError(f"{where}: 'architectures' must be a non-empty list of names, found {architectures!r}")
    section: dict[str, Any] = {"converted_by": TOOL, "serve": INSTALL}
    section.update((key, config.pop(key)) for key in MOVED if key in config)
    marked = {"architectures": [marker_name(a) for a in architectures], **config, SECTION: section}
    return (json.dumps(marked, indent=2, ensure_ascii=False) + "\n").encode()


def section_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``megamoe`` section of a ``config.json`` object, or None when it is not a conversion's."""
    section = config.get(SECTION)
    if not isinstance(section, dict) or section.get("converted_by") != TOOL:
        return None
    return section


def original(config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The source's ``config.json`` object back from a marked one (a copy; unmarked: unchanged)."""
    section = section_of(config)
    if section is None:
        return dict(config)
    architectures = section.get("architectures")
    if not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
        raise MarkerError(f"{where}: the {SECTION!r} section names no original architectures")
    if config.get("architectures") != [marker_name(a) for a in architectures]:
        raise MarkerError(f"{where}: architectures {config.get('architectures')!r} are not the markers of "
                          f"{architectures!r}")
    restored = {k: v for k, v in config.items() if k != SECTION}
    restored.update((key, section[key]) for key in MOVED if key in section)
    return restored


def restore(config: Any) -> dict[str, Any] | None:
    """An engine's parsed config object (attributes, ``PretrainedConfig``-like): put the original
    architectures (and ``auto_map``) back in place of the markers; returns the section, or None
    when the config is not a conversion's. The section stays on the object, so the model knows it
    is one. Idempotent; architectures the user overrode (no longer the markers) are left alone."""
    section = getattr(config, SECTION, None)
    if not isinstance(section, dict) or section.get("converted_by") != TOOL:
        return None
    originals = section.get("architectures")
    if isinstance(originals, list) and getattr(config, "architectures", None) == [marker_name(a) for a in originals]:
        for key in MOVED:
            if key in section:
                setattr(config, key, section[key])
    return section


def problem(config_bytes: bytes) -> str | None:
    """What is wrong with a conversion's ``config.json`` as a marker, or None (``verify``)."""
    try:
        config = json.loads(config_bytes)
        if not isinstance(config, dict) or section_of(config) is None:
            return ("has no megamoe marker (converted by an older megamoe-convert): an engine without "
                    "megamoe-convert would serve no experts; rerun the same convert command")
        original(config)
    except (UnicodeDecodeError, ValueError) as e:
        return str(e)
    return None


def small_file_problems(out: Path, sources: Sequence[Path]) -> Iterator[tuple[str, str | None]]:
    """Each of the source's small files against ``out``'s, byte for byte (``config.json`` as
    :func:`mark` writes it): (name, problem or None)."""
    for src in sources:
        want = src.read_bytes()
        if src.name == "config.json":
            want = mark(want, str(src))
        dst = out / src.name
        if not dst.is_file():
            yield src.name, "small file of the source is missing"
        elif dst.read_bytes() != want:
            yield src.name, "differs from the source" + (" marked by megamoe-convert" if src.name == "config.json" else "")
        else:
            yield src.name, None
