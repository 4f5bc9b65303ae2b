"""Every load format SGLang 0.5.23 knows (its ``LoadFormat`` enum and ``--load-format`` choices, with
the plugin's ``megamoe``), and what it does with a conversion
(:class:`~megamoe_convert.engines.format_matrix.Loads`).

The formats whose loader feeds the model's ``load_weights`` from the directory's top-level
safetensors serve the experts: the hooked ``load_weights`` installs them first (:mod:`.model_classes`).
Those that would find nothing of a conversion to read, read the experts from elsewhere, or reach
the weights past ``load_weights``, are refused around SGLang's ``get_model_loader`` before a
loader or a model is built (:func:`register`). ``tests/engines/test_sglang_format_matrix.py``
checks this table against SGLang's own lists.
"""

from __future__ import annotations

from typing import Any, Callable

from megamoe_convert.engines.format_matrix import Loads, Row, refusal
from megamoe_convert.engines.load_formats import LOAD_FORMAT
from megamoe_convert.errors import InstallError
from megamoe_convert.output import marker

#: SGLang's one entry from a ``LoadConfig`` to a loader (the model runner, ``get_model``, the
#: weight-cache daemon and weight updates all call it).
GET_MODEL_LOADER = "sglang.srt.model_loader.loader.get_model_loader"

_FEEDS = "SGLang's default loader feeds the model's hooked load_weights the top-level shards, experts installed first"
_NO_LOADER = "has no loader of its own in SGLang: its default loader rejects it while reading, experts in place"

FORMATS: dict[str, Row] = {
    "auto": Row(Loads.SERVES, _FEEDS),
    "safetensors": Row(Loads.SERVES, _FEEDS),
    LOAD_FORMAT: Row(Loads.SERVES, "the plugin's loader installs the rank's experts, then loads the rest as "
                                   "safetensors"),
    "presharded": Row(Loads.SERVES, "its first run loads as auto does (experts installed) and dumps the result; its "
                                    "reload of that dump is engines/sglang/presharded.py's"),
    "pt": Row(Loads.REFUSES, "reads *.pt files, and a conversion holds safetensors only"),
    "npcache": Row(Loads.REFUSES, "reads *.bin files, and a conversion holds safetensors only"),
    "mistral": Row(Loads.REFUSES, "reads consolidated*.safetensors, which a conversion does not hold"),
    "jax": Row(Loads.REFUSES, _NO_LOADER),
    "rdma": Row(Loads.REFUSES, _NO_LOADER),
    "local_cached": Row(Loads.REFUSES, _NO_LOADER),
    "private": Row(Loads.REFUSES, "loads through sglang.private's loader, which megamoe-convert does not prove"),
    "bitsandbytes": Row(Loads.REFUSES, "quantizes the checkpoint's weights as it loads them, and MegaMoE's pre-baked "
                                       "experts are no input of it"),
    "layered": Row(Loads.REFUSES, "loads module by module through load_weights_to_module, past the model's "
                                  "load_weights"),
    "flash_rl": Row(Loads.REFUSES, "quantizes the loaded weights to FP8 again"),
    "expert_pack": Row(Loads.REFUSES, "takes the experts from a GGUF expert pack, not from the conversion"),
    "dummy": Row(Loads.NO_WEIGHTS, "random weights by design: no file is read, no expert installed"),
    "sharded_state": Row(Loads.NO_LOCAL_FOLDER, "reads the model-rank-*-part-* files save_sharded_state writes, which "
                                                "neither a conversion nor its source holds"),
    "gguf": Row(Loads.NO_LOCAL_FOLDER, "reads one .gguf file: a folder is refused"),
    "remote": Row(Loads.NO_LOCAL_FOLDER, "reads a remote key-value store by its URL"),
    "remote_instance": Row(Loads.NO_LOCAL_FOLDER, "copies another running instance's weights (NCCL or a transfer "
                                                  "engine)"),
    "instanttensor": Row(Loads.NEEDS_GPU, _FEEDS + " (InstantTensor reads to the GPU)", Loads.SERVES),
    "fastsafetensors": Row(Loads.NEEDS_GPU, _FEEDS + " (fastsafetensors reads to the GPU)", Loads.SERVES),
    "runai_streamer": Row(Loads.NEEDS_GPU, "the RunAI streamer reads the top-level shards (not recursive) into the "
                                           "model's hooked load_weights; its package is carried to the GPU run",
                          Loads.SERVES),
    "ipc_cache": Row(Loads.NEEDS_GPU, "maps a weight-cache daemon's tensors over CUDA IPC; its disk fallback loads "
                                      "with the format it replaced", Loads.SERVES),
}


def format_name(load_format: Any) -> str:
    """``--load-format`` as SGLang's ``LoadConfig`` holds it (its enum, or the plugin's loader class)."""
    if isinstance(load_format, type):
        return LOAD_FORMAT if load_format.__name__ == "MegaMoEModelLoader" else load_format.__name__
    return str(getattr(load_format, "value", load_format))


def conversion_of(model_config: Any) -> str | None:
    """The conversion SGLang's ``ModelConfig`` loads (its config carries the marker's section), or None."""
    section = getattr(getattr(model_config, "hf_config", None), marker.SECTION, None)
    if marker.section_of({marker.SECTION: section}) is None:
        return None
    return str(getattr(model_config, "model_path", None) or "the converted directory")


def loader_around(get_model_loader: Callable[..., Any], load_config: Any, model_config: Any = None, *args: Any,
                  **kwargs: Any) -> Any:
    """``AROUND`` hook of SGLang's ``get_model_loader``: a conversion's load format that does not serve
    it is refused before any loader or model is built."""
    conversion = conversion_of(model_config)
    if conversion is not None:
        why = refusal(conversion, format_name(load_config.load_format), FORMATS, "SGLang")
        if why is not None:
            raise InstallError(why)
    return get_model_loader(load_config, model_config, *args, **kwargs)


#: The hook (target, ``AROUND`` hook) the plugin applies (``hooks.around``).
HOOKS = ((GET_MODEL_LOADER, loader_around),)
