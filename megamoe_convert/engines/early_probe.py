"""The layout probe while the model builds: the engine's own loading code runs on the first MoE block
the engine finishes, on the probe's thread, while the engine builds the rest of the model, so the
install finds the probe passed and its first reads wait for nothing.

:func:`watch` hooks torch's module registrations: the first module one of the install's contracts
detects (an experts module, complete once it is registered) is marked, and the next module registered
that holds it (its MoE block, complete with its shared expert, or a layer holding that) is probed.
The watch does nothing more once it started it, and ends when the model's install starts
(:func:`stop`: torch's hooks are not removed from within one, while torch iterates over them). Best effort:
a probe that fails or cannot run here runs again at the install (a failure is never remembered),
which refuses there in one line.
"""

from __future__ import annotations

import logging
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)

_lock = threading.Lock()
#: The registration hook while a watch is on.
_handle: RemovableHandle | None = None


def watch(conversion: str, installing: str) -> None:
    """Watch the model being built for its first MoE block, and probe it from ``conversion`` (a local
    directory) with the engine module ``installing`` (its ``CONTRACTS`` and ``ENGINE``; a block finished
    before that module is imported is passed over for the next one)."""
    global _handle, _started
    _started = None
    if not Path(conversion).is_dir():
        return
    from megamoe_convert import settings

    if not settings.layout_probe():
        return
    experts: list[nn.Module] = []
    done = threading.Event()

    def look(child: Any) -> None:
        engine = sys.modules.get(installing)
        if engine is None or not hasattr(engine, "ENGINE") or not isinstance(child, nn.Module):
            return  # (the install's module still importing: ENGINE is defined last)
        if experts:
            if any(m is experts[0] for m in child.modules()):  # a block holding it, complete
                done.set()
                _start(child, conversion, engine.ENGINE)
        elif any(c.detect(child) for c in engine.CONTRACTS):
            experts.append(child)

    def registered(parent: nn.Module, name: str, child: Any) -> None:
        # Never removes itself (torch is iterating over its hooks: stop() runs at the install), and
        # never raises into the engine's model build: whatever fails here, the install probes.
        if done.is_set():
            return
        try:
            look(child)
        except Exception as e:
            done.set()
            log.debug("megamoe: watching the model build for its first MoE block: %s", e)

    with _lock:
        if _handle is not None:
            _handle.remove()
        _handle = register_module_module_registration_hook(registered)


def stop() -> None:
    """End the watch (the model's install starts): never from within a registration hook."""
    global _handle
    with _lock:
        if _handle is not None:
            _handle.remove()
            _handle = None


def started() -> Future[None] | None:
    """The probe the last watch started, or ``None`` (a benchmark waits on it as a long model build would)."""
    return _started


#: The probe the last watch started.
_started: Future[None] | None = None


def _start(block: nn.Module, conversion: str, engine: Any) -> None:
    global _started
    from megamoe_convert.engines import probe

    _started = probe.in_background(lambda: _probe(block, conversion, engine))


def _probe(block: nn.Module, conversion: str, engine: Any) -> None:
    from megamoe_convert.engines.driver import probe_layouts
    from megamoe_convert.serve.loader import open_converted

    try:
        probe_layouts([(m, c, None) for m, c in engine.classify(block)], open_converted(conversion))
    except Exception as e:  # the install probes again, and refuses there
        log.debug("megamoe: the layout probe while the model builds did not pass (%s): the install probes", e)
