"""Every transformers name megamoe-convert uses that is not transformers' public API, in one place.

Both engines read every ``config.json`` through transformers, and the plugin makes transformers give
a conversion's back with the original ``model_type`` (:mod:`.hf_config`): only the one function all
of transformers' config reading goes through can do that (its public ``AutoConfig.register`` cannot:
see :mod:`.hf_config`). It is checked against the transformers of every supported engine release by
``tests/engines/test_vllm_private_hooks.py`` and ``tests/engines/test_sglang_private_hooks.py``. The
engines' own private names are in ``vllm/private_hooks.py`` and ``sglang/private_hooks.py``.
"""

from __future__ import annotations

from typing import Any, Callable

#: Every private name used here, as ``module:attribute.path`` (the tests resolve each in every release).
PRIVATE_NAMES = ("transformers.configuration_utils:PreTrainedConfig._dict_from_json_file",)

#: ``read(cls, json_file) -> dict``: transformers' JSON config reading, as its class method's function.
JsonConfigReader = Callable[[type, Any], Any]


def config_base() -> type | None:
    """transformers' configuration base class (``PreTrainedConfig``, ``PretrainedConfig`` before 5.0),
    or None without transformers."""
    try:
        from transformers import configuration_utils
    except ImportError:
        return None
    return getattr(configuration_utils, "PreTrainedConfig", None) or configuration_utils.PretrainedConfig


def json_config_reader(base: type) -> JsonConfigReader:
    """The function behind ``base._dict_from_json_file``, which every config reading of transformers
    calls (``AutoConfig``, ``get_config_dict``, the tokenizers' config)."""
    return base.__dict__["_dict_from_json_file"].__func__


def replace_json_config_reader(base: type, read: JsonConfigReader) -> None:
    """transformers reads every ``config.json`` with ``read`` from now on, in this process."""
    base_: Any = base  # transformers' class: untyped here
    base_._dict_from_json_file = classmethod(read)
