"""vLLM integration: put pre-baked MegaMoE tensors into ``DeepseekV4MegaMoEExperts`` modules.

vLLM's ``DeepseekV4MegaMoEExperts.finalize_weights()`` returns at once when
``_transformed_l1_weights`` is set; ``forward`` and the EPLB ``get_expert_weights`` views
then use ``_transformed_l1_weights`` / ``_transformed_l2_weights``. :func:`install` sets
exactly those from a rank's shards and drops the four loader-side parameters, as
``finalize_weights`` itself does.

vLLM is never imported at module import time: modules are matched by class name and
attributes, so this works against any vLLM version with the same attribute contract (and
against stand-ins in tests). :func:`register` is the ``vllm.general_plugins`` entry point
that adds ``--load-format megamoe``.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from .loader import ExpertLayer, load_rank
from .manifest import Manifest, read_manifest

log = logging.getLogger(__name__)

#: Class names of vLLM's MegaMoE expert modules (the newer common class included).
EXPERT_CLASS_NAMES = ("DeepseekV4MegaMoEExperts", "DeepGemmMegaMoEExperts")
REQUIRED_ATTRIBUTES = ("prefix", "experts_start_idx", "num_local_experts", "hidden_size", "intermediate_size")
#: The loader-side parameters that ``finalize_weights`` frees once the layout exists.
LOADER_PARAMETERS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
LOAD_FORMAT = "megamoe"
#: What vLLM's own weight iterator must never fetch from a hub repo: the rank folders
#: (``install`` pulls just this rank's shards itself).
RANK_FILES_PATTERN = "rank-*-of-*/*"

#: ``model.layers.7.ffn.experts``, ``model.layers.43.mtp_block.ffn.experts``, ``model.mtp.0.ffn.experts``.
VLLM_PREFIX = re.compile(r"^(?:model\.)?(?P<kind>layers|mtp)\.(?P<index>\d+)\.(?:mtp_block\.)?ffn\.experts$")
#: Checkpoint tensor names of routed experts (what the megamoe load format never reads).
EXPERT_TENSOR_NAME = re.compile(r"\.experts\.(\d+\.)?w[123]")


class InstallError(ValueError):
    """A model whose MegaMoE modules do not match the converted directory."""


def is_megamoe_experts(module: nn.Module) -> bool:
    return type(module).__name__ in EXPERT_CLASS_NAMES and all(hasattr(module, a) for a in REQUIRED_ATTRIBUTES)


def find_megamoe_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_megamoe_experts(m)]


def layer_key(prefix: str, num_hidden_layers: int) -> str:
    """vLLM module prefix -> checkpoint layer key (``layers.7`` / ``mtp.0``).

    vLLM numbers MTP blocks after the decoder layers (``model.layers.{N+i}``); the
    checkpoint calls them ``mtp.{i}``.
    """
    m = VLLM_PREFIX.match(prefix)
    if m is None:
        raise InstallError(f"{prefix}: not a MegaMoE experts prefix (expected model.layers.N.ffn.experts)")
    index = int(m["index"])
    if m["kind"] == "mtp":
        return f"mtp.{index}"
    return f"layers.{index}" if index < num_hidden_layers else f"mtp.{index - num_hidden_layers}"


def current_ep_rank() -> int:
    """This process's rank in vLLM's expert-parallel group."""
    try:
        from vllm.distributed import get_ep_group
    except ImportError as e:
        raise InstallError("rank=None needs vLLM's EP group, but vllm is not importable; pass rank=") from e
    return int(get_ep_group().rank_in_group)


def _num_hidden_layers(out: Path) -> int:
    try:
        return int(json.loads((out / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InstallError(f"{out / 'config.json'}: cannot read num_hidden_layers ({e})") from None


def _module_device(module: nn.Module) -> torch.device:
    for name in LOADER_PARAMETERS:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_module(module: nn.Module, manifest: Manifest, rank: int, where: Path) -> None:
    """Every number the module was built with must be the one the shards were built for."""
    placement, dims = manifest.placement, manifest.dims
    expected = {
        "experts_start_idx": placement.experts_start(rank),
        "num_local_experts": placement.experts_per_rank,
        "num_experts": placement.n_physical,
        "num_logical_experts": placement.n_logical,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.moe_intermediate_size,
    }
    for attribute, want in expected.items():
        got = getattr(module, attribute, want)
        if got is None and attribute == "num_logical_experts":
            got = getattr(module, "num_experts", want)
        if got != want:
            raise InstallError(f"{module.prefix}: {attribute} is {got} in the model but {want} in {where} "
                               f"(rank {rank}, ep_size {placement.ep_size})")
    if not placement.is_default():
        raise InstallError(f"{module.prefix}: the conversion uses an explicit expert placement, but "
                           f"{type(module).__name__} maps physical slot p to logical p % num_logical_experts; "
                           "convert with the default placement to serve it with vLLM")


def set_transformed(module: nn.Module, layer: ExpertLayer) -> None:
    """What ``finalize_weights`` leaves behind, without it doing any work."""
    module._transformed_l1_weights = (layer.l1.weight, layer.l1.sf)
    module._transformed_l2_weights = (layer.l2.weight, layer.l2.sf)
    for name in LOADER_PARAMETERS:
        if hasattr(module, name):
            setattr(module, name, None)


def install(model: nn.Module, out: Path | str, rank: int | None = None, *, verify: bool = False) -> int:
    """Load rank ``rank``'s MegaMoE tensors from ``out`` into every MegaMoE module of ``model``.

    ``out`` is a converted directory (or a hub repo id). ``rank=None`` takes the current
    EP rank from vLLM. Returns the number of layers installed; raises :class:`InstallError`
    naming the layer and both values on any mismatch, before any module is changed.
    """
    rank = current_ep_rank() if rank is None else rank
    from .hub import resolve_converted

    out = resolve_converted(out, [rank])
    modules = find_megamoe_modules(model)
    if not modules:
        raise InstallError(f"no {' / '.join(EXPERT_CLASS_NAMES)} modules in the model")
    manifest = read_manifest(out)
    n_layers = _num_hidden_layers(out)
    keyed = {layer_key(m.prefix, n_layers): m for m in modules}
    available = {l.key for l in manifest.layers}
    missing = sorted(set(keyed) - available)
    if missing:
        raise InstallError(f"{keyed[missing[0]].prefix}: layer {missing[0]} is not in {out} "
                           f"(converted layers: {', '.join(sorted(available))})")
    for module in modules:
        check_module(module, manifest, rank, out)
    by_device: dict[torch.device, list[str]] = {}
    for key, module in keyed.items():
        by_device.setdefault(_module_device(module), []).append(key)
    for device, keys in by_device.items():
        loaded = load_rank(out, rank, device=device, layers=keys, verify=verify)
        for key in keys:
            set_transformed(keyed[key], loaded[f"{key}.ffn.experts"])
    log.info("megamoe: installed %d MegaMoE layers for EP rank %d from %s", len(keyed), rank, out)
    return len(keyed)


# --------------------------------------------------------------------------------------
# --load-format megamoe
# --------------------------------------------------------------------------------------

def without_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The default safetensors iterator, minus routed-expert tensors (installed separately)."""
    return ((name, t) for name, t in weights if not EXPERT_TENSOR_NAME.search(name))


def as_safetensors_config(load_config: Any) -> Any:
    """A copy of vLLM's ``LoadConfig`` for the default loader underneath: ``DefaultModelLoader``
    knows only its own formats (``megamoe`` would be "Unknown load_format"), so the non-expert
    shards are read as plain safetensors, and the rank folders are never downloaded."""
    if load_config is None:
        return None
    config = copy.copy(load_config)
    config.load_format = "safetensors"
    ignore = config.ignore_patterns
    config.ignore_patterns = [*([ignore] if isinstance(ignore, str) else (ignore or [])), RANK_FILES_PATTERN]
    return config


def refuse_experts_only(out: str) -> None:
    """An ``--experts-only`` conversion has no non-expert weights for vLLM to load: say so,
    rather than vLLM's "Cannot find any model weights"."""
    path = Path(out)
    if path.is_dir() and read_manifest(path).experts_only:
        raise InstallError(f"{path}: converted with --experts-only, so it holds no non-expert weights to serve; "
                           "convert without --experts-only for --load-format megamoe")


def make_loader_class(default_loader: type) -> type:
    """A ``DefaultModelLoader`` subclass: experts from the shards, everything else as usual."""

    class MegaMoEModelLoader(default_loader):  # type: ignore[misc, valid-type]
        """``--load-format megamoe``: ``vllm serve OUT`` where OUT is a ``megamoe convert`` output."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(as_safetensors_config(load_config))

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            refuse_experts_only(model_config.model)
            install(model, model_config.model)  # first: frees the loader-side expert parameters
            model.load_weights(without_expert_tensors(self.get_all_weights(model_config, model)))

    return MegaMoEModelLoader


def register() -> None:
    """``vllm.general_plugins`` entry point: register ``--load-format megamoe`` (no-op without vLLM)."""
    try:
        from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader
    except ImportError:
        log.debug("megamoe: vllm not importable; --load-format megamoe not registered")
        return
    register_model_loader(LOAD_FORMAT)(make_loader_class(DefaultModelLoader))
