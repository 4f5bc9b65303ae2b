"""Transformers reads a conversion's ``config.json`` with the source's ``model_type`` (with the plugin).

A converted directory's ``config.json`` carries a marker ``model_type`` (``output/marker.py``) that no
config registry knows, so that an engine without megamoe-convert refuses it wherever it reads the
config: every engine reads it through transformers (``AutoConfig.from_pretrained``,
``PretrainedConfig.get_config_dict``: vLLM's ``hf`` config parser, its speculative draft config,
the weight-cache daemon; SGLang's ``get_config``; both engines' ``AutoTokenizer``, whose choice of
tokenizer class depends on ``model_type``). With megamoe-convert installed, :func:`register` (run
by each engine's plugin entry point, in every process that loads plugins) wraps the one function
all of those go through, ``PreTrainedConfig._dict_from_json_file`` (:mod:`.private_hooks`), so
that a conversion's dict comes back with the original ``model_type``
(:func:`marker.restore_model_type`: only a conversion's marker is touched, anything else is
returned as read). The engine then parses, configures and tokenizes exactly as for the source;
the architecture markers are restored by each engine's model classes (``engines/*/model_classes.py``).

transformers' public ``AutoConfig.register`` cannot do this: it maps a model type to a config
class whose ``model_type`` must be that same (marker) type, so the engine would read the marker
where it keys settings and the tokenizer on the original type.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from megamoe_convert.engines import private_hooks
from megamoe_convert.output import marker

log = logging.getLogger(__name__)

#: Set on the wrapping function, so that a second :func:`register` in one process is a no-op.
WRAPPED_ATTR = "megamoe_restores_model_type"


def register() -> bool:
    """Wrap transformers' JSON config reading (idempotent); False without transformers."""
    base = private_hooks.config_base()
    if base is None:
        log.debug("megamoe: transformers not importable; config.json read as written")
        return False
    read = private_hooks.json_config_reader(base)
    if getattr(read, WRAPPED_ATTR, False):
        return True

    @functools.wraps(read)
    def _dict_from_json_file(cls: type, json_file: Any) -> Any:
        config = read(cls, json_file)
        return marker.restore_model_type(config) if isinstance(config, dict) else config

    setattr(_dict_from_json_file, WRAPPED_ATTR, True)
    private_hooks.replace_json_config_reader(base, _dict_from_json_file)
    return True
