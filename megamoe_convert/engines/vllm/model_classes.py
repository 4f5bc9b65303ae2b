"""Every vLLM load format serves a conversion's pre-baked experts, or refuses (vLLM 0.30 and later).

A converted directory's ``config.json`` names a marker model type and marker architectures
(``output/marker.py``) that a bare vLLM refuses. With megamoe-convert installed, the
``vllm.general_plugins`` entry point (:mod:`.plugin`, in every vLLM process, before any config is
read) does this:

- transformers' JSON config reading gives back the original model type (``engines/hf_config.py``:
  vLLM's parser, its speculative draft config, the weight-cache daemon and the tokenizer all read
  through it), and vLLM's ``hf`` config parser is replaced (``register_config_parser``,
  :func:`register_config_parser`) by one that puts the original
  architectures back, so vLLM builds and configures the model exactly as for the source (every
  architecture-keyed setting of vLLM applies); the ``megamoe`` section stays on the config.
- Each model class that holds MegaMoE experts (DeepSeek-V4, V4.1, Kimi-K3 and their MTP / DSpark
  drafts) is registered again (``ModelRegistry.register_model``, :func:`register_models`) as a
  thin subclass of vLLM's own class whose ``load_weights``
  first installs the rank's pre-baked experts (:func:`.install.install_layers`, which
  refuses a model that does not match) and then loads the rest as vLLM would. Every loader that
  calls ``load_weights`` (``auto``, ``safetensors``, ``megamoe``, ``pt``, ``fastsafetensors``, ...)
  therefore serves the experts. On a directory that is no conversion the subclass is vLLM's class.
- vLLM's Transformers-backend classes (``--model-impl transformers``) are registered again as
  subclasses that refuse a conversion before they are built: they have no MegaMoE experts.

A conversion whose ``config.json`` lost its ``megamoe`` section is no conversion to vLLM; the
subclass's first ``load_weights`` refuses it: vLLM fed it no routed-expert tensor
(``load_formats.ExpertTensorCount``), so its experts would stay zeros.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterable

import torch
from torch import nn

from megamoe_convert.engines.load_formats import (
    INSTALLED_ATTR,
    load_installing,
    prepare_install,
    served_reference,
)
from megamoe_convert.engines.vllm import private_hooks
from megamoe_convert.errors import InstallError
from megamoe_convert.output import marker

log = logging.getLogger(__name__)

#: vLLM architectures whose models hold MegaMoE experts: target models, and drafts (whose config
#: is the speculative config's draft model config).
TARGETS = ("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM", "KimiK3ForConditionalGeneration")
DRAFTS = ("DeepSeekV4MTPModel", "DSparkDraftModel", "DSparkV41DraftModel", "KimiK3MTPModel")
#: Where the subclass keeps the conversion it serves (``None``: vLLM's class, unchanged).
CONVERSION_ATTR = "megamoe_conversion"
#: The model (directory or hub repo id) the subclass was built for (named in a refusal).
MODEL_ATTR = "megamoe_model"


def conversion_of(model_config: Any) -> str | None:
    """The converted directory (or hub repo id, ``@revision`` when one is asked for) a vLLM
    ``ModelConfig`` loads, or None: a conversion's config carries the marker's section."""
    if model_config is None:
        return None
    if marker.section_of({marker.SECTION: getattr(model_config.hf_config, marker.SECTION, None)}) is None:
        return None
    return served_reference(str(model_config.model), getattr(model_config, "revision", None))


def installed_parameter_names(model: nn.Module, layers: Iterable[nn.Module]) -> set[str]:
    """The qualified names of the parameters of ``layers`` (what vLLM's loaded-weights check expects
    ``load_weights`` to have loaded)."""
    wanted = {id(m) for m in layers}
    return {f"{name}.{p}" if name else p for name, module in model.named_modules() if id(module) in wanted
            for p, _ in module.named_parameters(recurse=False)}


def make_model_class(base: Any, draft: bool) -> type:
    """vLLM's ``base`` with a ``load_weights`` that installs a conversion's experts first."""
    class MegaMoEModel(base):
        def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
            spec = getattr(vllm_config, "speculative_config", None)
            own = getattr(spec, "draft_model_config", None) if draft else vllm_config.model_config
            out = conversion_of(own)
            if out is not None:
                from megamoe_convert.engines.vllm import format_table  # on a conversion only (the plugin's cost)

                format_table.refuse_unserved(out, vllm_config)  # before vLLM builds anything
                from megamoe_convert.serve.staging import prepare_gpu_staging  # at first use (the plugin's cost)

                prepare_gpu_staging(out)  # pin the read ring while vLLM builds the model
                prepare_install(out, "megamoe_convert.engines.vllm.installing")  # its imports and probe input too
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            setattr(self, CONVERSION_ATTR, out)
            setattr(self, MODEL_ATTR, str(getattr(own, "model", base.__name__)))

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
            from megamoe_convert.engines.vllm.installing import CONTRACTS, install_layers  # at first use

            out = getattr(self, CONVERSION_ATTR, None)
            names: set[str] = set()
            if out is not None and getattr(self, INSTALLED_ATTR, None) is None:  # before 0.30-0.32 release them
                names = installed_parameter_names(self, [m for m in self.modules()
                                                         if any(c.detect(m) for c in CONTRACTS)])
            loaded = load_installing(self, super().load_weights, weights, out, install_layers, CONTRACTS,
                                     getattr(self, MODEL_ATTR, base.__name__), "vLLM")
            return loaded | names if isinstance(loaded, set) else loaded

    MegaMoEModel.__name__ = MegaMoEModel.__qualname__ = base.__name__
    MegaMoEModel.__module__ = __name__  # model_class() sets the qualname vLLM's registry (and pickle) looks up
    return MegaMoEModel


def make_refusing_class(base: Any, arch: str) -> type:
    """vLLM's Transformers-backend ``base`` (``--model-impl transformers``): it has no MegaMoE experts
    modules, so on a conversion it is refused before it is built."""
    class NoMegaMoEModel(base):
        def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
            out = conversion_of(vllm_config.model_config)
            if out is not None:
                raise InstallError(f"{out}: vLLM would build {arch} (its Transformers backend), which has no MegaMoE "
                                   "experts to install the conversion into; serve it with vLLM's own implementation "
                                   "(drop --model-impl transformers)")
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)

    NoMegaMoEModel.__name__ = NoMegaMoEModel.__qualname__ = base.__name__
    NoMegaMoEModel.__module__ = __name__
    return NoMegaMoEModel


#: The attribute suffix of the Transformers-backend classes that refuse a conversion.
REFUSE = "__refuse"


def _vllm_suffix() -> str:
    import vllm

    return "__vllm_" + vllm.__version__.replace(".", "_").replace("+", "_").replace("-", "_")


@functools.cache
def model_class(attribute: str) -> type:
    """This module's attribute ``ARCH__vllm_X_Y_Z``: the subclass of vLLM's class for ``ARCH``."""
    arch = attribute.partition("__vllm_")[0]
    refuse = arch.endswith(REFUSE)
    arch = arch.removesuffix(REFUSE)
    base = private_hooks.model_class(arch)
    made = make_refusing_class(base, arch) if refuse else make_model_class(base, draft=arch in DRAFTS)
    made.__qualname__ = attribute  # what vLLM's registry imports (and pickle finds) in any process
    return made


def __getattr__(name: str) -> type:  # the lazy "module:class" vLLM's registry imports
    if "__vllm_" not in name:
        raise AttributeError(name)
    return model_class(name)


def make_config_parser(base: Any) -> type:
    """vLLM's ``HFConfigParser`` putting a conversion's original architectures back."""

    class MegaMoEConfigParser(base):
        def parse(self, model: Any, *args: Any, **kwargs: Any) -> tuple[dict, Any]:
            config_dict, config = super().parse(model, *args, **kwargs)
            if marker.restore(config) is not None:
                refuse_family_vllm_cannot_serve(model, getattr(config, "model_type", None))
                log.info("megamoe: %s is a megamoe-convert conversion of %s", model, config.architectures)
            return config_dict, config

    return MegaMoEConfigParser


def refuse_family_vllm_cannot_serve(model: Any, model_type: Any) -> None:
    """A conversion of a family whose MegaMoE vLLM does not run (SGLang's SM90 FP8 families) is
    refused when its config is read: vLLM would build the family's own modules, which take none of
    the pre-baked experts, and serve them empty."""
    from megamoe_convert.source import engines_table, families  # on a conversion only (the plugin's cost)

    family = next((f for f in families.FAMILIES if model_type in f.model_types), None)
    if family is not None and (why := engines_table.family_refusal(family, "vllm")) is not None:
        raise InstallError(f"{model}: a megamoe-convert conversion of {family.title}, which vLLM cannot serve: {why}")


def register_config_parser() -> None:
    """vLLM's ``hf`` config parser, replaced by one putting a conversion's architectures back."""
    from vllm.transformers_utils import config as config_utils

    base = config_utils.get_config_parser("hf").__class__
    if base.__name__ != "MegaMoEConfigParser":
        config_utils.register_config_parser("hf")(make_config_parser(base))


def register_models() -> None:
    """Every MegaMoE model class, and every Transformers-backend class, registered again as its
    subclass here (see the module docstring)."""
    from vllm.model_executor.models import ModelRegistry

    suffix = _vllm_suffix()
    for arch in TARGETS + DRAFTS:
        if arch in ModelRegistry.models:
            ModelRegistry.register_model(arch, f"{__name__}:{arch}{suffix}")
    for arch in private_hooks.transformers_backend_architectures():
        if arch in ModelRegistry.models:
            ModelRegistry.register_model(arch, f"{__name__}:{arch}{REFUSE}{suffix}")
