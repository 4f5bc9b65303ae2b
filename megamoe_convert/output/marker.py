"""The converted directory's own guard: ``config.json`` names a marker architecture and model type.

A converted directory's top-level shards hold no routed experts, so an engine that loads it as an
ordinary checkpoint would serve zeros. ``convert`` therefore writes ``OUT/config.json`` with

- every ``architectures`` entry replaced by a marker name that no engine registers (a bare vLLM or
  SGLang refuses it when it resolves the model class: "Model architectures [...] are not
  supported"), and
- ``model_type`` replaced by a marker model type that no config registry knows: transformers'
  ``AutoConfig`` (which every engine's config reading goes through) refuses it ("has model type
  `MegaMoE-converted deepseek_v4: ...` but Transformers does not recognize this architecture"),
  so a bare engine refuses the directory before any model class is chosen, even one that builds
  Hugging Face's modeling from ``model_type`` (SGLang's ``--model-impl transformers``),

each saying what to install, and a ``megamoe`` section holding what was replaced. With
megamoe-convert installed in the engine's environment, its plugin gives every reader of the
config the original ``model_type`` back (transformers' JSON reading: :func:`restore_model_type`)
and the original architectures (the engine's config parser: :func:`restore`), and installs each
rank's pre-baked experts whichever load format reads the directory (``engines/vllm/model_classes.py``,
``engines/sglang/model_classes.py``).

The change is exact and deterministic: :func:`mark` of the source's bytes is what ``config.json``
holds (``verify --source`` checks that byte for byte), and :func:`original` gives back the source's
``config.json`` object. ``auto_map`` moves into the section too, so no engine can fall back to a
checkpoint's own remote code for the marker name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

from megamoe_convert.errors import MarkerError

#: The ``config.json`` key of the section (also the attribute engines' config objects carry).
SECTION = "megamoe"
#: What the section names as the tool (a conversion's ``config.json`` is recognised by it).
TOOL = "megamoe-convert"
#: Keys moved from the top level into the section (restored by :func:`original`).
MOVED = ("architectures", "auto_map")
#: What to run, in every marker name and in the section.
INSTALL = "install megamoe-convert into this serving environment"
#: The key replaced by a marker model type; the section holds the original (``None``: the source had none).
MODEL_TYPE = "model_type"


def marker_name(architecture: str) -> str:
    """The name a bare engine reads in place of ``architecture`` (and prints when it refuses it)."""
    return f"MegaMoE-converted {architecture}: {INSTALL}"


def marker_model_type(model_type: str | None) -> str:
    """The ``model_type`` a bare engine reads in place of ``model_type`` (``None``: the source had
    none); transformers prints it when it refuses it."""
    return f"MegaMoE-converted {model_type or 'checkpoint'}: {INSTALL}"


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
    model_type = config.get(MODEL_TYPE)
    if model_type is not None and not isinstance(model_type, str):
        raise MarkerError(f"{where}: 'model_type' must be a name, found {model_type!r}")
    section: dict[str, Any] = {"converted_by": TOOL, "serve": INSTALL}
    section.update((key, config.pop(key)) for key in MOVED if key in config)
    section[MODEL_TYPE] = model_type
    marks = {MODEL_TYPE: marker_model_type(model_type)}  # where the source had it (else after architectures)
    marked = {"architectures": [marker_name(a) for a in architectures], **({} if MODEL_TYPE in config else marks),
              **{k: marks.get(k, v) for k, v in config.items()}, SECTION: section}
    return (json.dumps(marked, indent=2, ensure_ascii=False) + "\n").encode()


def section_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``megamoe`` section of a ``config.json`` object, or None when it is not a conversion's."""
    section = config.get(SECTION)
    if not isinstance(section, dict) or section.get("converted_by") != TOOL:
        return None
    return section


def original(config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The source's ``config.json`` object back from a marked one (a copy; a config with no section:
    unchanged)."""
    section = section_of(config)
    if section is None:
        return dict(config)
    architectures = section.get("architectures")
    if not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
        raise MarkerError(f"{where}: the {SECTION!r} section names no original architectures")
    if config.get("architectures") != [marker_name(a) for a in architectures]:
        raise MarkerError(f"{where}: architectures {config.get('architectures')!r} are not the markers of "
                          f"{architectures!r}")
    if MODEL_TYPE not in section:
        raise MarkerError(f"{where}: the {SECTION!r} section names no original model_type")
    if config.get(MODEL_TYPE) != marker_model_type(section[MODEL_TYPE]):
        raise MarkerError(f"{where}: model_type {config.get(MODEL_TYPE)!r} is not the marker of "
                          f"{section[MODEL_TYPE]!r}")
    restored = restore_model_type({k: v for k, v in config.items() if k != SECTION}, section)
    restored.update((key, section[key]) for key in MOVED if key in section)
    return restored


def restore_model_type(config: dict[str, Any], section: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config`` (a ``config.json`` object) with the original ``model_type`` in place of the marker
    model type, everything else as it is (architecture markers and the section included): what
    the plugin makes transformers read, so that every reader of the config sees the source's model
    type. Anything else (no conversion's, a model type already changed) is returned unchanged, as
    the same object."""
    section = section_of(config) if section is None else section
    if section is None or MODEL_TYPE not in section or config.get(MODEL_TYPE) != marker_model_type(section[MODEL_TYPE]):
        return config
    restored = dict(config)
    if section[MODEL_TYPE] is None:
        del restored[MODEL_TYPE]
    else:
        restored[MODEL_TYPE] = section[MODEL_TYPE]
    return restored


def restore(config: Any) -> dict[str, Any] | None:
    """An engine's parsed config object (attributes, ``PretrainedConfig``-like): put the original
    architectures (and ``auto_map``) back in place of the markers, and the original model type in
    place of a marker one (transformers reads it restored already when the plugin is loaded);
    returns the section, or None when the config is not a conversion's. The section stays on the
    object, so the model knows it is one. Idempotent; what the user overrode (no longer the
    markers) is left alone."""
    section = getattr(config, SECTION, None)
    if not isinstance(section, dict) or section.get("converted_by") != TOOL:
        return None
    originals = section.get("architectures")
    if isinstance(originals, list) and getattr(config, "architectures", None) == [marker_name(a) for a in originals]:
        for key in MOVED:
            if key in section:
                setattr(config, key, section[key])
    if MODEL_TYPE in section and getattr(config, MODEL_TYPE, None) == marker_model_type(section[MODEL_TYPE]):
        setattr(config, MODEL_TYPE, section[MODEL_TYPE])
    return section


def problem(config_bytes: bytes) -> str | None:
    """What is wrong with a conversion's ``config.json`` as a marker, or None (``verify``)."""
    try:
        config = json.loads(config_bytes)
        if not isinstance(config, dict) or section_of(config) is None:
            return ("has no megamoe marker: an engine without megamoe-convert would serve no experts; rerun the "
                    "same convert command")
        original(config)
    except (ValueError, MarkerError) as e:  # not JSON (nor UTF-8), or not a marker original() reads
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
            marked = " marked by megamoe-convert" if src.name == "config.json" else ""
            yield src.name, "differs from the source" + marked
        else:
            yield src.name, None
