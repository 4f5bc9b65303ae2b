"""Every SGLang load format serves a conversion's pre-baked experts, or refuses (SGLang 0.5.23).

A converted directory's ``config.json`` names a marker model type and marker architectures
(``output/marker.py``): a bare SGLang refuses the model type when it reads the config (through
transformers' ``AutoConfig``, whatever ``--model-impl``), and the architecture when it resolves the
model class. With megamoe-convert installed, the ``sglang.srt.plugins`` entry point
(:mod:`.plugin`) makes transformers read the original model type (``engines/hf_config.py``) and
the plugin wraps (:data:`HOOKS`, applied as SGLang's ``HookRegistry`` would: :mod:`.hooks`):

- around SGLang's ``get_config``: the original architectures are put back (SGLang then builds
  and configures the model exactly as for the source); the ``megamoe`` section stays on the
  config and records the directory. A conversion SGLang cannot serve (of a family the serving
  table gives SGLang none of, such as DeepSeek-V4.1 and Kimi-K3, or per-rank files for vLLM's
  placement) is refused right there, in one line; a store of a family SGLang serves passes (its
  placement is read from SGLang's modules at install).
- around ``load_weights`` of SGLang's MegaMoE model classes (and their NextN drafts):
  the rank's experts are installed first (:func:`.install.install_layers`, which refuses a model
  that does not match), then everything else loads as SGLang would. Every loader that calls the
  model's ``load_weights`` (``auto``, ``safetensors``, ``megamoe``, ``pt``, ...) therefore serves
  the experts; around ``get_model_architecture``, any other class (``--model-impl transformers``)
  is refused.

A conversion whose ``config.json`` lost its ``megamoe`` section is no conversion to SGLang; the
hooked ``load_weights`` refuses it: SGLang fed it no routed-expert tensor, so its experts would stay
zeros.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from megamoe_convert.engines.load_formats import (
    conversion_manifest,
    load_installing,
    prepare_install,
    served_reference,
)
from megamoe_convert.engines.sglang import format_table, hooks, private_hooks
from megamoe_convert.errors import InstallError
from megamoe_convert.output import marker
from megamoe_convert.output.naming import ANY_ENGINE

#: SGLang's config reader (``ModelConfig`` and the tokenizer manager import it by name; ``hooks.around``
#: re-points those bindings).
GET_CONFIG = "sglang.srt.utils.hf_transformers.config.get_config"
#: SGLang's model-class resolution (``--model-impl``): only the classes below serve a conversion.
GET_MODEL_ARCHITECTURE = "sglang.srt.model_loader.utils.get_model_architecture"
#: SGLang's model classes that hold MegaMoE experts, each defining its own ``load_weights``.
LOAD_WEIGHTS = ("sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.load_weights",
                "sglang.srt.models.deepseek_v4_nextn.DeepseekV4ForCausalLMNextN.load_weights",
                # Hopper's FP8 MegaMoE (sm90_fp8.py): DeepSeek-V3/R1 and its NextN draft, Qwen3-MoE
                "sglang.srt.models.deepseek_v2.DeepseekV3ForCausalLM.load_weights",
                "sglang.srt.models.deepseek_nextn.DeepseekV3ForCausalLMNextN.load_weights",
                "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM.load_weights")
#: The section's key recording the directory (or hub repo id) the config was read from.
PATH_KEY = "path"
#: The install's module (imported on a thread of its own while SGLang builds a conversion's model).
INSTALLING = "megamoe_convert.engines.sglang.installing"


def manifest_refusal(path: str, revision: str | None = None) -> str | None:
    """Why SGLang serves none of a conversion (local, or a hub repo's), by its manifest: a family no
    SGLang contract serves (the serving table's word), or per-rank files for another engine's
    placement; a store of a family SGLang serves passes (its placement is SGLang's own, read at
    install). ``None`` also where no manifest could be read: install decides."""
    data = conversion_manifest(path, revision)
    if data is None:
        return None
    from megamoe_convert.source import engines_table, families  # a conversion's: at first use

    family = next((f for f in families.FAMILIES if f.name == data.get("family")), None)
    if family is not None and (why := engines_table.family_refusal(family, "sglang")) is not None:
        return f"a conversion of {family.title}, which SGLang does not serve ({why})"
    engine = data.get("engine")
    if engine not in ("sglang", ANY_ENGINE):
        return (f"converted for {engine}'s expert placement, which SGLang does not serve; convert it with "
                f"--engine sglang, or without --ep-size (a store), or serve this one with {engine}")
    return None


def config_around(get_config: Callable[..., Any], model: Any, *args: Any, **kwargs: Any) -> Any:
    """``AROUND`` hook of SGLang's ``get_config`` (see the module docstring)."""
    config = get_config(model, *args, **kwargs)
    section = marker.restore(config)
    if section is None:
        return config
    if (why := unserved_hooks()) is not None:
        raise InstallError(f"{model}: {why}")
    revision = _revision(args, kwargs)
    if (refusal := manifest_refusal(str(model), revision)) is not None:
        raise InstallError(f"{model}: {refusal}")
    section[PATH_KEY] = served_reference(str(model), revision)
    return config


def unserved_hooks() -> str | None:
    """Why this process cannot serve a conversion: a gate left unhooked (this SGLang lacks it, or its
    module was hooked half-imported), or a target of the plugin's that another plugin replaces
    outright; ``None`` where neither."""
    missing = [target for target, hook in GATES.items() if target in hooks.MISSING or not hooks.in_place(target, hook)]
    if missing:
        return (f"megamoe-convert's hook of {', '.join(missing)} is not in place in this SGLang (the release lacks "
                "it, or something replaced it), and that hook refuses what would load no expert of a conversion; "
                "serve the source checkpoint, or an SGLang release megamoe-convert supports")
    replaced = private_hooks.replaced_elsewhere(hooks.TARGETS)
    if replaced:
        return (f"another SGLang plugin replaces {', '.join(replaced)}, where megamoe-convert installs a conversion's "
                "experts or refuses it; serve the source checkpoint, or disable that plugin (SGLANG_PLUGINS)")
    return None


def _revision(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The revision SGLang's ``get_config(model, trust_remote_code, revision, ...)`` was asked for."""
    return kwargs.get("revision", args[1] if len(args) > 1 else None)


def conversion_of(model: nn.Module) -> str | None:
    """The converted directory an SGLang model was built from (its config's section), or None."""
    section = getattr(getattr(model, "config", None), marker.SECTION, None)
    if isinstance(section, dict) and section.get("converted_by") == marker.TOOL and section.get(PATH_KEY):
        return str(section[PATH_KEY])
    return None


def load_weights_around(load_weights: Callable[..., Any], model: nn.Module,
                        weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any) -> Any:
    """``AROUND`` hook of the models' ``load_weights``: a conversion's experts first, then the rest."""
    from megamoe_convert.engines.sglang.installing import CONTRACTS, install_layers  # a MegaMoE model's first load

    name = getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
    return load_installing(model, lambda w: load_weights(model, w, *args, **kwargs), weights, conversion_of(model),
                           install_layers, CONTRACTS, str(name), "SGLang")


def architecture_around(get_model_architecture: Callable[..., Any], model_config: Any, *args: Any,
                        **kwargs: Any) -> Any:
    """``AROUND`` hook of SGLang's ``get_model_architecture``: a conversion is served only by the
    model classes whose ``load_weights`` installs it (``--model-impl transformers`` would build
    Hugging Face's modeling, which has no MegaMoE experts)."""
    model_cls, arch = get_model_architecture(model_config, *args, **kwargs)
    section = getattr(getattr(model_config, "hf_config", None), marker.SECTION, None)
    if isinstance(section, dict) and section.get("converted_by") == marker.TOOL:
        served = {target.rsplit(".", 2)[-2] for target in LOAD_WEIGHTS}
        where = section.get(PATH_KEY, "the converted directory")
        if (why := unserved_hooks()) is not None:
            raise InstallError(f"{where}: {why}")
        if not any(cls.__name__ in served for cls in model_cls.__mro__):
            raise InstallError(f"{where}: SGLang would build {arch}, which megamoe-convert cannot install experts "
                               f"into (it serves {', '.join(sorted(served))}); drop --model-impl transformers")
        if not hooks.hooked(getattr(model_cls, "load_weights", None), load_weights_around):
            raise InstallError(f"{where}: {model_cls.__name__}.load_weights of this SGLang is not the one "
                               "megamoe-convert hooks, so it would load no expert of the conversion; serve the source "
                               "checkpoint, or an SGLang release megamoe-convert supports")
        from megamoe_convert.serve.staging import prepare_gpu_staging  # a conversion's: at first use

        prepare_gpu_staging(section.get(PATH_KEY))  # in the worker, right before the model is built: pin meanwhile
        if section.get(PATH_KEY):  # and make the install's imports, the probe's input, and the probe meanwhile
            prepare_install(str(section[PATH_KEY]), INSTALLING)
    return model_cls, arch


#: The hooks without which a conversion could be served with its experts uninstalled: the load
#: formats' and the model classes' gates.
GATES: dict[str, Callable[..., Any]] = {format_table.GET_MODEL_LOADER: format_table.loader_around,
                                        GET_MODEL_ARCHITECTURE: architecture_around}
#: The hooks (target, ``AROUND`` hook) the plugin applies (``hooks.around``); a load format that does
#: not serve a conversion is refused first (``format_table``).
HOOKS = ((GET_CONFIG, config_around), (GET_MODEL_ARCHITECTURE, architecture_around), *format_table.HOOKS,
         *((target, load_weights_around) for target in LOAD_WEIGHTS))
