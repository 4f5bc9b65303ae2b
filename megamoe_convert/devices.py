"""Turning a user's device string into a ``torch.device`` that this process can really use.

Checked up front, so that ``--device cuda`` on a machine without a GPU (or ``cuda:3`` on a
machine with one) is a one-line error before any file is read, not a CUDA traceback later.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from megamoe_convert.errors import DeviceError

if TYPE_CHECKING:  # torch is imported when a device is checked, so `megamoe --help` stays quick
    import torch


class Device(str, Enum):
    """The device choices the command line offers."""
    cpu = "cpu"
    cuda = "cuda"


def usable_device(spec: str | torch.device, flag: str = "") -> torch.device:
    """``spec`` as a ``torch.device`` of type ``cpu`` or ``cuda`` that exists here (``flag``: the
    option it came from, named in the error)."""
    import torch

    on = f"{flag}: " if flag else ""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise DeviceError(f"{on}device {spec!r} is not a device (use cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceError(f"{on}device {str(device)!r} is not supported (use cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        drop = f"; leave out {flag} to run on the CPU (the default)" if flag else ""
        raise DeviceError(f"{on}device {str(device)!r}: no CUDA GPU is available to this process{drop}")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"{on}device {str(device)!r}: this process sees {count} CUDA GPU(s) "
                          f"(cuda:0 to cuda:{count - 1})")
    return device
