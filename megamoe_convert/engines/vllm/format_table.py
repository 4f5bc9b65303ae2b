"""Every load format vLLM 0.30-0.33 registers (with the plugin's ``megamoe``), and what it does with
a conversion (:class:`~megamoe_convert.engines.format_matrix.Loads`).

The formats whose loader feeds the model's ``load_weights`` from the directory's top-level
safetensors serve the experts: the plugin's subclass installs them first (:mod:`.model_classes`).
Those that would find nothing of a conversion to read, or read it through a path this package does
not prove, are refused by that subclass before vLLM builds the model (:func:`refuse_unserved`).
``tests/engines/test_vllm_format_matrix.py`` checks this table against vLLM's registry.
"""

from __future__ import annotations

from typing import Any

from megamoe_convert.engines.format_matrix import Loads, Row, refusal
from megamoe_convert.errors import InstallError

_FEEDS = ("vLLM's default loader feeds the model's load_weights the top-level shards; the plugin's subclass "
          "installs first")

FORMATS: dict[str, Row] = {
    "auto": Row(Loads.SERVES, _FEEDS),
    "hf": Row(Loads.SERVES, _FEEDS),
    "safetensors": Row(Loads.SERVES, _FEEDS),
    "megamoe": Row(Loads.SERVES, "the plugin's loader installs the rank's experts, then loads the rest as safetensors"),
    "pt": Row(Loads.REFUSES, "reads *.pt files, and a conversion holds safetensors only"),
    "npcache": Row(Loads.REFUSES, "reads *.bin files, and a conversion holds safetensors only"),
    "mistral": Row(Loads.REFUSES, "reads consolidated*.safetensors, which a conversion does not hold"),
    "tensorizer": Row(Loads.REFUSES, "reads a tensorizer file instead of the conversion's shards"),
    "modelexpress": Row(Loads.REFUSES, "loads through ModelExpress's own strategies (a peer's GPU memory, GPUDirect "
                                       "Storage), which megamoe-convert does not prove"),
    "dummy": Row(Loads.NO_WEIGHTS, "random weights by design: no file is read, no expert installed"),
    "sharded_state": Row(Loads.NO_LOCAL_FOLDER, "reads the model-rank-*-part-* files save_sharded_state writes, which "
                                                "neither a conversion nor its source holds"),
    "runai_streamer_sharded": Row(Loads.NO_LOCAL_FOLDER, "the same files as sharded_state, through the RunAI streamer"),
    "fastsafetensors": Row(Loads.NEEDS_GPU, _FEEDS + " (fastsafetensors reads to the GPU)", Loads.SERVES),
    "instanttensor": Row(Loads.NEEDS_GPU, _FEEDS + " (InstantTensor reads to the GPU)", Loads.SERVES),
    "runai_streamer": Row(Loads.NEEDS_GPU, "the RunAI streamer reads the top-level shards (not recursive) into the "
                                           "model's load_weights; its package is carried to the GPU run", Loads.SERVES),
    "ipc_cache": Row(Loads.NEEDS_GPU, "maps a weight-cache daemon's tensors over CUDA IPC; its disk fallback is "
                                      "--load-format megamoe (engines/vllm/weight_cache.py)", Loads.SERVES),
}


def refuse_unserved(conversion: str, vllm_config: Any) -> None:
    """Refuse building a model of ``conversion`` for a load format that does not serve it (the format
    ``vllm_config`` loads with; a config without one, as some callers build, passes)."""
    load_config = getattr(vllm_config, "load_config", None)
    load_format = getattr(load_config, "load_format", None)
    if load_format is None:
        return
    why = refusal(conversion, str(getattr(load_format, "value", load_format)), FORMATS, "vLLM")
    if why is not None:
        raise InstallError(why)
