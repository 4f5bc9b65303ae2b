"""Every error megamoe-convert raises on purpose: one base, one subclass per stage.

The command line catches :class:`MegamoeError` once and prints its message as one line; a stage
raises the class of the stage that found the problem, and the stages above let it pass as it is
(no ``raise OtherError(str(e))``), so the message a user reads names the file or tensor where the
problem was found. Each class also keeps the builtin class it derived from before the family
existed (``ValueError``, ``RuntimeError``, ``OSError``), so callers catching those still do.
"""

from __future__ import annotations


class MegamoeError(Exception):
    """Base of every error the tool raises on purpose: the CLI prints it in one line and exits 2."""


# --- arguments and shared helpers --------------------------------------------------------

class UsageError(MegamoeError, ValueError):
    """A command pointed at the wrong kind of thing (a source where a conversion is expected)."""


class JsonError(MegamoeError, ValueError):
    """Invalid JSON, or JSON of the wrong shape (see :func:`megamoe_convert.jsonio.parse`)."""


class DeviceError(MegamoeError, ValueError):
    """A device string that is malformed, not supported, or not present on this machine."""


# --- source/: what a model ships -----------------------------------------------------------

class SourceError(MegamoeError, ValueError):
    """A source checkpoint that cannot be read or converted as it is."""


class CheckpointError(SourceError):
    """A source checkpoint that cannot be converted as it is."""


class FamilyError(SourceError):
    """A ``config.json`` of no model family megamoe-convert reads."""


class FormatError(SourceError):
    """A weight format (or a checkpoint's experts) that megamoe-convert does not support."""


class SafetensorsError(SourceError):
    """A file that is not a well-formed safetensors file."""


# --- placement and layout: pure functions --------------------------------------------------

class PlacementError(MegamoeError, ValueError):
    """An impossible or inconsistent expert placement."""


class LayoutError(MegamoeError, ValueError):
    """Inputs that cannot be laid out (bad shape, dtype or dimension)."""


# --- output/: what a conversion writes -----------------------------------------------------

class OutputError(MegamoeError, ValueError):
    """A conversion's output that is missing, incomplete or inconsistent."""


class ManifestError(OutputError):
    """A missing, incomplete, unknown or inconsistent manifest. ``problems`` lists every
    inconsistency found (``megamoe verify`` reports them all); the message names the first."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class MarkerError(OutputError):
    """A ``config.json`` that cannot be marked, or a marker that does not say what it replaced."""


class LinkInOutput(MegamoeError, OSError):
    """A path the tool would write passes a symbolic link (or a non-directory) below its root."""


# --- convert/ and synth/: the jobs ---------------------------------------------------------

class ConvertError(MegamoeError, RuntimeError):
    """A conversion that cannot start or continue (bad options, busy or foreign OUT)."""


class OutputBusy(ConvertError):
    """Another run is writing OUT in a way this one cannot run beside."""


class Cancelled(ConvertError):
    """A conversion stopped by its caller (Ctrl-C, SIGTERM, a cancelled future)."""


class MergeError(ConvertError):
    """Parts that cannot be merged (missing, foreign, overlapping, or corrupted)."""


class SynthError(MegamoeError, ValueError):
    """An output folder ``synth`` must not write into."""


# --- serve/ and engines/: reading a conversion back, installing it -------------------------

class LoadError(MegamoeError, ValueError):
    """A rank that cannot be loaded from this directory, and why."""


class PreloadError(LoadError):
    """A conversion (or a command line) the weight-cache daemon cannot serve."""


class HubError(MegamoeError, RuntimeError):
    """A hub repo that cannot be found, read, written or trusted."""


class InstallError(MegamoeError, ValueError):
    """A model whose MegaMoE modules do not match the converted directory (or no known contract)."""
