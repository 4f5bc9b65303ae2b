"""Every error megamoe-convert raises on purpose: one base, one subclass per stage.

The command line catches :class:`MegamoeError` once and prints its message as one line; a stage
raises the class of the stage that found the problem, and the stages above let it pass as it is
(no ``raise OtherError(str(e))``), so the message a user reads names the file or tensor where the
problem was found. No class is also a builtin error: a ``except ValueError`` (or ``OSError``) meant
for a library's or the system's error never swallows one of ours.
"""

from __future__ import annotations


class MegamoeError(Exception):
    """Base of every error the tool raises on purpose: the CLI prints it in one line and exits 2."""


# --- arguments and shared helpers --------------------------------------------------------

class UsageError(MegamoeError):
    """A command pointed at the wrong kind of thing (a source where a conversion is expected)."""


class JsonError(MegamoeError):
    """Invalid JSON, or JSON of the wrong shape (see :func:`megamoe_convert.jsonio.parse`)."""


class DeviceError(MegamoeError):
    """A device string that is malformed, not supported, or not present on this machine."""


class SettingError(MegamoeError):
    """A ``MEGAMOE_*`` environment variable set to a value it does not accept (``settings.py``)."""


class DependencyError(MegamoeError):
    """A package the tool needs (torch) that is missing, cannot be imported, or is too old."""


# --- source/: what a model ships -----------------------------------------------------------

class SourceError(MegamoeError):
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

class PlacementError(MegamoeError):
    """An impossible or inconsistent expert placement."""


class LayoutError(MegamoeError):
    """Inputs that cannot be laid out (bad shape, dtype or dimension)."""


# --- output/: what a conversion writes -----------------------------------------------------

class OutputError(MegamoeError):
    """A conversion's output that is missing, incomplete or inconsistent."""


class ManifestError(OutputError):
    """A missing, incomplete, unknown or inconsistent manifest. ``problems`` lists every
    inconsistency found (``megamoe verify`` reports them all); the message names the first."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class MarkerError(OutputError):
    """A ``config.json`` that cannot be marked, or a marker that does not say what it replaced."""


class LinkInOutput(MegamoeError):
    """A path the tool would write passes a symbolic link (or a non-directory) below its root."""


# --- convert/ and synth/: the jobs ---------------------------------------------------------

class ConvertError(MegamoeError):
    """A conversion that cannot start or continue (bad options, busy or foreign OUT)."""


class OutputBusy(ConvertError):
    """Another run is writing OUT in a way this one cannot run beside."""


class Cancelled(ConvertError):
    """A conversion stopped by its caller (Ctrl-C, SIGTERM, a cancelled future)."""


class MergeError(ConvertError):
    """Parts that cannot be merged (missing, foreign, overlapping, or corrupted)."""


class SynthError(MegamoeError):
    """An output folder ``synth`` must not write into."""


# --- serve/ and engines/: reading a conversion back, installing it -------------------------

class LoadError(MegamoeError):
    """A rank that cannot be loaded from this directory, and why."""


class PreloadError(LoadError):
    """A conversion (or a command line) the weight-cache daemon cannot serve."""


class HubError(MegamoeError):
    """A hub repo that cannot be found, read, written or trusted."""


class InstallError(MegamoeError):
    """A model whose MegaMoE modules do not match the converted directory (or no known contract)."""
