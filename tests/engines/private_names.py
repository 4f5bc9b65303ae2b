"""What both engines' private-hooks tests share: a name of the engine's code as its
``private_hooks.PRIVATE_NAMES`` writes it (``package.module:Class.attribute``), looked up in the
release at hand, and the check of the transformers hook both engines' plugins use."""

from __future__ import annotations

import importlib


def resolve(dotted: str) -> object:
    """The object ``dotted`` names; an ``ImportError`` or ``AttributeError`` where this release has none."""
    module, _, path = dotted.partition(":")
    found: object = importlib.import_module(module)
    for part in path.split("."):
        found = getattr(found, part)
    return found


def transformers_reads_through_the_replaced_reader(tmp_path) -> None:
    """What ``engines/hf_config.py`` relies on: the reader :mod:`megamoe_convert.engines.private_hooks`
    puts in place is what transformers' own config reading calls."""
    from megamoe_convert.engines import private_hooks

    base = private_hooks.config_base()
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4"}')
    read, seen = private_hooks.json_config_reader(base), []

    def recording(cls, json_file):
        seen.append(str(json_file))
        return read(cls, json_file)

    try:
        private_hooks.replace_json_config_reader(base, recording)
        config, _ = base.get_config_dict(str(tmp_path))
    finally:
        private_hooks.replace_json_config_reader(base, read)
    assert config["model_type"] == "deepseek_v4" and seen == [str(tmp_path / "config.json")]
