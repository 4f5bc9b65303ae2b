"""What every engine's ``--load-format megamoe`` and model classes share: the engine's default loader
underneath reads the converted directory's non-expert shards as plain safetensors, minus the
routed-expert tensors and the shared experts that ``install`` put in place (both from the rank's
own shards), and never fetches the rank folders of a hub repo; a conversion's manifest (local, or a
hub repo's) is read where an engine must know more than its marker says (:func:`conversion_manifest`),
and a checkpoint without routed experts that no marker names is refused (:class:`ExpertTensorCount`).
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import logging
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import torch

from megamoe_convert.engines import early_probe
from megamoe_convert.engines.contract import Contract
from megamoe_convert.errors import InstallError
from megamoe_convert.output import marker
from megamoe_convert.output.naming import MANIFEST_NAME

if TYPE_CHECKING:  # the driver is imported where an install runs, not by the plugin
    from megamoe_convert.engines.driver import Installed

LOAD_FORMAT = "megamoe"
#: What the engine's own weight iterator must never fetch from a hub repo: the rank folders
#: (``install`` pulls just this rank's shards itself).
RANK_FILES_PATTERN = "rank-*-of-*/*"
#: Nor a store's expert files (``install`` reads just this rank's slots of them itself).
STORE_FILES_PATTERN = "experts/*"
#: Set on a model once its conversion's experts are installed (by the load format or by the
#: model's own ``load_weights``), so that the other does not install them again.
INSTALLED_ATTR = "megamoe_installed"
#: A snapshot directory of the HF cache: ``.../models--owner--name/snapshots/<commit>``.
HF_SNAPSHOT = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")
#: What an engine feeds a model's ``load_weights``: ``(name, tensor)`` pairs.
Weights = Iterable[tuple[str, torch.Tensor]]


@functools.cache
def expert_tensor_name() -> re.Pattern[str]:
    """Checkpoint tensor names of routed experts (what the megamoe load format never reads), by every
    family's projection names (``experts.3.w1``, ``experts.3.gate_proj``; never ``shared_experts``):
    made at the first load, as the families table is not the plugin's to import in every process."""
    from megamoe_convert.source import families

    return re.compile(r"\.experts\.(\d+\.)?(%s)" % "|".join(
        sorted({re.escape(name) for family in families.FAMILIES for name in family.projections.values()})))

log = logging.getLogger(__name__)


def conversion_manifest(model: Any, revision: str | None = None) -> dict[str, Any] | None:
    """The megamoe ``manifest.json`` of ``model`` as read: a local directory's, or a hub repo's (a
    repo id or a snapshot of one in the HF cache: :func:`hub_manifest`, one small file, as the
    engine downloads ``config.json``); None when it has none or it cannot be had."""
    manifest = Path(str(model)) / MANIFEST_NAME
    if not manifest.is_file():
        found = hub_manifest(model, revision)
        if found is None:
            return None
        manifest = found
    try:
        data = json.loads(manifest.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "layout_version" in data and "placement" in data else None


def hub_manifest(model: Any, revision: str | None = None) -> Path | None:
    """``manifest.json`` of the hub repo ``model`` (``owner/name``, ``owner/name@revision``, or a
    snapshot directory of the HF cache), from the cache or else downloaded; None when the repo has
    none, or it cannot be had."""
    text = str(model)
    snapshot = HF_SNAPSHOT.search(text) if Path(text).is_dir() else None
    if snapshot is not None:
        repo_id, revision = f"{snapshot['owner']}/{snapshot['name']}", snapshot["commit"]
    elif Path(text).exists():
        return None
    else:
        from megamoe_convert.hub.pull import parse_repo_ref

        ref = parse_repo_ref(text)
        if ref is None:
            return None
        repo_id, revision = ref[0], revision or ref[1]
    import huggingface_hub

    try:
        cached = huggingface_hub.try_to_load_from_cache(repo_id, MANIFEST_NAME, revision=revision)
        if isinstance(cached, str):
            return Path(cached)
        if cached is not None:  # the cache knows the repo has no manifest
            return None
        return Path(huggingface_hub.hf_hub_download(repo_id, MANIFEST_NAME, revision=revision))
    except Exception as e:  # no such file or repo, offline, unreachable: no manifest to read
        log.debug("megamoe: no manifest for %s@%s: %s", repo_id, revision, e)
        return None


class ExpertTensorCount:
    """The weights an engine feeds a model's ``load_weights``, counted as they pass: a checkpoint
    of a MegaMoE model always holds routed-expert tensors, so a stream without any (while other
    tensors came) is a conversion no marker named, whose experts would stay zeros:
    :meth:`refusal` says so."""

    def __init__(self, weights: Weights) -> None:
        self.weights, self.experts, self.tensors = weights, 0, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        expert = expert_tensor_name().search
        for name, tensor in self.weights:
            self.tensors += 1
            self.experts += bool(expert(name))
            yield name, tensor

    def refusal(self, model: str, engine: str) -> str | None:
        if self.experts or not self.tensors:
            return None
        return (f"{model}: {engine} read {self.tensors} tensors and not one routed expert: the checkpoint holds "
                "none, so its MegaMoE experts would stay zeros (a megamoe-convert conversion whose config.json "
                f"lost its {marker.SECTION} section, say); serve a conversion with --load-format {LOAD_FORMAT}, or "
                "rerun the megamoe convert that made it")


def without_expert_tensors(weights: Weights, installed: Installed | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The default safetensors iterator, minus routed-expert tensors and the shared-expert
    tensors ``installed`` put in place from the rank files (``Installed.skip``)."""
    skip = installed.skip if installed else frozenset()
    expert = expert_tensor_name().search
    return ((name, t) for name, t in weights if not expert(name) and name not in skip)


def as_safetensors_config(load_config: Any) -> Any:
    """A copy of the engine's ``LoadConfig`` for the default loader underneath, which knows only
    its own formats (``megamoe`` would be unknown): plain safetensors, rank folders ignored."""
    if load_config is None:
        return None
    config = copy.copy(load_config)
    config.load_format = "safetensors"  # both engines' LoadFormat values compare equal to their strings
    ignore = config.ignore_patterns
    config.ignore_patterns = [*([ignore] if isinstance(ignore, str) else (ignore or [])), RANK_FILES_PATTERN,
                             STORE_FILES_PATTERN]
    return config


#: Set on a model that is no marked conversion once its first ``load_weights`` was checked.
CHECKED_ATTR = "megamoe_checked"


def served_reference(model: str, revision: str | None) -> str:
    """What a conversion is installed from: a local directory as named, a hub repo id at the
    revision the engine serves (``owner/name@revision``)."""
    return f"{model}@{revision}" if revision and "@" not in model and not Path(model).exists() else model


def load_checked(model: Any, load: Callable[[Weights], Any], weights: Weights, name: str, engine: str) -> Any:
    """``load(weights)`` for a MegaMoE model that is no marked conversion: its first load is
    counted, and refused when the engine fed it tensors but not one routed expert
    (:class:`ExpertTensorCount`); later loads (and an installed model's) pass through."""
    if getattr(model, CHECKED_ATTR, False) or getattr(model, INSTALLED_ATTR, None) is not None:
        return load(weights)
    counted = ExpertTensorCount(weights)
    loaded = load(counted)
    setattr(model, CHECKED_ATTR, True)
    if getattr(model, INSTALLED_ATTR, None) is None and (refusal := counted.refusal(name, engine)):
        raise InstallError(refusal)
    return loaded


def install_once(model: Any, conversion: str, install: Callable[..., Installed]) -> Installed:
    """The conversion's experts in ``model``: installed here unless the load format or an earlier
    ``load_weights`` did, so that neither installs them twice."""
    installed = getattr(model, INSTALLED_ATTR, None)
    if installed is None:
        early_probe.stop()  # the install probes what the model build has not
        installed = install(model, conversion, serving=True)
        setattr(model, INSTALLED_ATTR, installed)
    return installed


def load_installing(model: Any, load: Callable[[Weights], Any], weights: Weights, conversion: str | None,
                    install: Callable[..., Installed], contracts: Sequence[Contract], name: str, engine: str) -> Any:
    """A MegaMoE model's ``load_weights`` in either engine's model classes: a conversion's experts
    first (:func:`install_once`), then ``load`` of the rest; a model that is no conversion loads as
    the engine loads it, its first load refused when the checkpoint held no routed expert
    (:func:`load_checked`)."""
    if conversion is not None:
        return load(without_expert_tensors(weights, install_once(model, conversion, install)))
    if not any(c.detect(m) for m in model.modules() for c in contracts):
        return load(weights)
    return load_checked(model, load, weights, name, engine)


def prepare_install(conversion: str, installing: str) -> threading.Thread:
    """Make what a conversion's first install needs while the engine builds the model, on a thread of
    its own: the install's modules (``installing`` and what it imports) and, for a local conversion,
    the layout probe's input and this package's layout of it (:func:`probe.prepare`), then the probe
    itself on the first MoE block the engine builds (:mod:`.early_probe`). Best effort: whatever fails
    here the install makes again, and raises there."""
    thread = threading.Thread(target=_prepare_install, args=(conversion, installing), name="megamoe-prepare",
                              daemon=True)
    thread.start()
    early_probe.watch(conversion, installing)  # and the probe itself, on the first MoE block built
    return thread


def _prepare_install(conversion: str, installing: str) -> None:
    try:
        importlib.import_module(installing)
        from megamoe_convert.engines import probe
        from megamoe_convert.output.manifest import read_manifest

        if not probe.enabled() or not Path(conversion).is_dir():
            return
        dims = read_manifest(Path(conversion)).dims
        probe.prepare(dims.format, dims.hidden_size, dims.moe_intermediate_size, dims.shared_intermediate_size or 0)
    except Exception as e:  # the install itself reports what is wrong
        log.debug("megamoe: preparing the install of %s ahead: %s", conversion, e)
