"""The layout probe: before an install changes any module, the engine's own loading code lays out
one synthetic expert, and its bytes must be this conversion's layout of the same input.

The contract, EP numbers, dtypes, shapes and strides are all checked before an install; an engine
or DeepGEMM release that lays the same shapes out in another byte order passes every one of those
checks. Only the engine's code, run in the serving process, can say which order it uses, so each
contract hands :func:`check_layout` a :class:`LayoutProbe` whose ``run`` feeds the probe's input
(``output/layout_identity.py``: random bytes from a fixed seed, the layer's format and dims, in the
checkpoint's form) through the engine's own loader or transform on a scratch twin of a real module
(:func:`scratch_twin`: nothing of the real module is written) and returns what the engine made of
it, by rank-file key, in kernel form. It is compared with this package's layout of the same input,
and its fingerprint with the one the conversion recorded. A difference refuses in one line naming
the engine, the tensor and what to do; a probe that cannot run refuses too, unless the caller opted
out (``probe=False`` or ``MEGAMOE_LAYOUT_PROBE=0``), which is logged as unchecked on every install.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata, util
from typing import Any, Callable, Mapping

import torch
from torch import nn

from megamoe_convert import settings
from megamoe_convert.errors import InstallError
from megamoe_convert.layout.identity import (
    PROVEN,
    ProbeInput,
    Tensors,
    difference,
    fingerprints,
    probe_dims,
    reference,
    routed_only,
    synthetic_expert,
)
from megamoe_convert.source import formats
from megamoe_convert.source.formats import WeightFormat

log = logging.getLogger(__name__)

#: ``0``: install without the probe (logged as unchecked on every install); read when an install asks.
OPT_OUT_ENV = settings.LAYOUT_PROBE

@dataclass(frozen=True)
class LayoutProbe:
    """One contract's probe of one module: ``engine`` names the engine, its version and its DeepGEMM
    (``vLLM 0.33.0 (DeepGEMM 2.8.1)``); ``where`` the module whose twin runs it; ``run`` feeds the
    input through the engine's own code and returns its kernel-form tensors by rank-file key; ``shapes``
    (this package's, by the same key) only size the twin's parameters."""

    engine: str
    where: str
    run: Callable[[ProbeInput, Mapping[str, tuple[int, ...]]], Tensors]
    contract: str = ""


#: (engine, contract, format, hidden, intermediate, shared) -> the fingerprint that passed.
_passed: dict[tuple[Any, ...], dict[str, str]] = {}


def enabled(probe: bool | None = None) -> bool:
    """Whether to probe: the caller's ``probe``, else the environment (on unless ``MEGAMOE_LAYOUT_PROBE=0``)."""
    if probe is not None:
        return probe
    return settings.layout_probe()


def check_layout(probe: LayoutProbe, fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0,
                 recorded: Mapping[str, str] | None = None) -> dict[str, str]:
    """Run ``probe`` once per process for this engine and input (a failure is never remembered, so
    every install refuses), compare with :func:`reference`, and with the conversion's ``recorded``
    fingerprints (``routed`` / ``shared``) where it has them. Returns the fingerprints; raises
    :class:`InstallError` in one line."""
    dims = probe_dims(hidden, inter, shared_inter)
    key = (probe.engine, probe.contract, fmt.name, *dims)
    done = _passed.get(key)
    if done is None:
        made, want = expected(fmt, *dims)
        inp = dataclasses.replace(made, routed={k: t.clone() for k, t in made.routed.items()},
                                  shared={k: t.clone() for k, t in made.shared.items()})  # the engine's to change
        try:
            got = probe.run(inp, {name: tuple(t.shape) for name, t in want.items()})
        except Exception as e:  # the engine's own code: whatever it raises, the layout is unknown
            raise InstallError(f"{probe.engine}: the layout probe cannot run the engine's own loading code on "
                               f"{probe.where} ({type(e).__name__}: {_one_line(e)}); install what the engine runs "
                               f"MegaMoE with, or pass probe=False / set {OPT_OUT_ENV}=0 to serve unchecked") from e
        for name in want:
            try:
                why = difference(got.get(name), want[name])
            except Exception as e:  # not a tensor, or one with no bytes to read
                why = f"what it holds cannot be compared ({type(e).__name__}: {_one_line(e)})"
            if why:
                raise InstallError(f"{probe.engine}: its own loading code lays out {probe.where} "
                                   f"{formats.FILE_NAMES[name]} ({inp.describe()}) differently from this "
                                   f"conversion: {why}; do not serve this conversion with it: use an engine "
                                   f"release megamoe-convert proves ({_proven()}), or serve the original "
                                   "checkpoint without --load-format megamoe")
        done = _passed[key] = fingerprints(want)
        log.info("megamoe: layout probe passed: %s lays out %s as megamoe-convert does (%s)",
                 probe.engine, inp.describe(), ", ".join(f"{k} {v}" for k, v in done.items()))
    for part, value in done.items():
        if recorded and part in recorded and recorded[part] != value:
            raise InstallError(f"{probe.engine}: the conversion records {part} layout fingerprint {recorded[part]}, "
                               f"but this engine's own loading code gives {value} for {probe.where}: it was "
                               "written with another layout; convert it again with this megamoe-convert")
    return done


#: (format, probe dims) -> the probe's input and this package's layout of it, made or being made.
_expected: dict[tuple[Any, ...], Future[tuple[ProbeInput, Tensors]]] = {}
_expected_lock = threading.Lock()


def expected(fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0) -> tuple[ProbeInput, Tensors]:
    """The probe's input for these (probe) dims and this package's layout of it: made once per process,
    ahead of the install where :func:`prepare` started it (the engine's model build overlaps it)."""
    key = (fmt.name, hidden, inter, shared_inter)
    while True:
        with _expected_lock:
            made = _expected.get(key)
            mine = made is None
            if made is None:
                made = _expected[key] = Future()
        if mine:
            try:
                inp = synthetic_expert(fmt, hidden, inter, shared_inter)
                made.set_result((inp, reference(inp)))
            except BaseException as e:  # not kept: the next call makes it again, and raises where it raises
                with _expected_lock:
                    _expected.pop(key, None)
                made.set_exception(e)
            return made.result()
        try:
            return made.result()
        except Exception:  # another thread's making failed (and is not kept): made again here
            continue


def prepare(fmt: WeightFormat, hidden: int, inter: int, shared_inter: int = 0) -> None:
    """Make :func:`expected` for a layer's dims now, on the calling thread (a start's own, while the engine
    builds the model), so the install's probe finds it made: with a shared expert, and its routed part
    alone (what an install whose modules fuse no shared expert probes)."""
    dims = probe_dims(hidden, inter, shared_inter)
    made = expected(fmt, *dims)
    if dims[2]:
        alone: Future[tuple[ProbeInput, Tensors]] = Future()
        alone.set_result(routed_only(*made))
        with _expected_lock:
            _expected.setdefault((fmt.name, *dims[:2], 0), alone)


def in_background(probes: Callable[[], None]) -> Future[None]:
    """Run ``probes`` (an install's) on the probe's own thread, beside the load's first reads, in the
    caller's torch context: its CUDA device, its default device (vLLM loads under ``with
    torch.device(...)``, and an engine's loader may allocate by default) and its autograd modes."""
    default = torch.get_default_device()
    cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run() -> None:
        if cuda is not None:
            torch.cuda.set_device(cuda)
        with torch.device(default), torch.set_grad_enabled(grad), torch.inference_mode(inference):
            probes()

    global _thread
    if _thread is None:
        _thread = ThreadPoolExecutor(1, thread_name_prefix="megamoe-layout-probe")
    return _thread.submit(run)


#: The probe's thread (made at the first install; a forked child, which has none, makes its own).
_thread: ThreadPoolExecutor | None = None


def _forget_thread() -> None:
    global _thread
    _thread = None


os.register_at_fork(after_in_child=_forget_thread)


def skipped(where: str) -> None:
    """The caller opted out: say so on every install (never silently)."""
    log.warning("megamoe: layout probe skipped (probe=False or %s=0) for %s: the engine's byte layout "
                "is unchecked", OPT_OUT_ENV, where)


def forget() -> None:
    """Forget every passed probe and every made input (a later install makes and probes again)."""
    _passed.clear()
    with _expected_lock:
        _expected.clear()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _proven() -> str:
    return "; ".join(f"{name} {', '.join(v)}" for name, v in PROVEN.items() if name != "deep_gemm")


# --------------------------------------------------------------------------------------
# Helpers every engine's probe uses
# --------------------------------------------------------------------------------------

def scratch_twin(module: nn.Module, parameters: Mapping[str, torch.Tensor], **attributes: Any) -> nn.Module:
    """A scratch copy of ``module`` the engine's own methods can run on without touching it: its
    ``parameters`` are new Parameters (each with the real one's attributes: ``weight_loader``,
    ``quant_method``...), every other parameter ``None``; buffers and tensor attributes cloned,
    dict / list / set attributes copied, children shared (the probes call nothing of them);
    ``attributes`` set on the twin (e.g. one local expert slot)."""
    twin = object.__new__(type(module))
    state = {}
    for name, value in vars(module).items():
        if isinstance(value, torch.Tensor):
            value = value.clone()
        elif isinstance(value, (dict, list, set)):
            value = copy.copy(value)
        state[name] = value
    real = module._parameters
    state["_parameters"] = {name: None for name in real}
    state["_buffers"] = {name: None if b is None else b.clone() for name, b in module._buffers.items()}
    twin.__dict__.update(state)
    for name, data in parameters.items():
        param = nn.Parameter(data, requires_grad=False)
        if real.get(name) is not None:
            for attr, value in vars(real[name]).items():
                if getattr(value, "__self__", None) is module:  # a loader bound to the real module: to the twin
                    value = value.__func__.__get__(twin, type(twin))
                setattr(param, attr, value)
        twin._parameters[name] = param
    for name, value in attributes.items():
        setattr(twin, name, value)
    return twin


def like(param: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zero tensor of ``shape`` laid out like ``param``: its dims in ``param``'s memory order (a scale
    parameter's MN-major view stays MN-major), on its device, of its dtype unless ``dtype``."""
    order = sorted(range(param.dim()), key=lambda d: (param.stride(d), d), reverse=True)
    device = "cpu" if param.is_meta else param.device  # a module built on meta (weight cache): bytes on the host
    storage = torch.zeros([shape[d] for d in order], dtype=dtype or param.dtype, device=device)
    return storage.permute([order.index(d) for d in range(len(order))])


def package_version(name: str) -> str | None:
    """The installed version of a distribution, or ``None``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def module_version(name: str) -> str | None:
    """``__version__`` of the module ``import name`` would give, without importing it where it is not
    imported yet (DeepGEMM's import initialises CUDA); ``None`` when there is none."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return getattr(loaded, "__version__", None) or "unknown"
    try:
        spec = util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    try:
        with open(spec.origin, encoding="utf-8", errors="replace") as f:
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        return None
    return found[1] if found else (package_version(name.replace("_", "-")) or "unknown")
