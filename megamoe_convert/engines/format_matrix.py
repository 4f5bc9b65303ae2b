"""What each of an engine's load formats does with a conversion: one class per format, per engine.

Every way an engine can read a conversion either serves the pre-baked experts (byte-exact with
the engine's own loading of the source) or refuses before serving. Each engine package keeps the
table of its registered formats (``engines/vllm/format_table.py``, ``engines/sglang/format_table.py``);
its plugin refuses a ``REFUSES`` format on a conversion before any module changes
(:func:`refusal`), and ``tests/engines/test_*_format_matrix.py`` reads the engine's own registry at
test time, so a format a new release adds fails there until it is classified.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

from megamoe_convert.engines.load_formats import LOAD_FORMAT


class Loads(enum.Enum):
    """What a load format does with a conversion."""

    #: Serves the pre-baked experts, byte-exact with the engine's own loading of the source.
    SERVES = "serves"
    #: The plugin refuses it on a conversion before any module changes, in one line naming the format that works.
    REFUSES = "refuses"
    #: Reads no checkpoint folder (its own files, a remote source): the engine refuses the source as it refuses
    #: a conversion.
    NO_LOCAL_FOLDER = "no local folder"
    #: Reads no weights at all (random values by design): nothing to install, and no real load.
    NO_WEIGHTS = "no weights"
    #: Its package or its transport needs a GPU: what it does (``Row.on_gpu``) is proven by the GPU run.
    NEEDS_GPU = "needs a GPU"


@dataclass(frozen=True)
class Row:
    """One load format: its class, why, and for ``NEEDS_GPU`` what the GPU run proves it does."""

    kind: Loads
    why: str
    on_gpu: Loads | None = None


def table_problems(table: Mapping[str, Row]) -> list[str]:
    """What is inconsistent in ``table``: a ``NEEDS_GPU`` row without its outcome, or another with one."""
    problems = []
    for name, row in table.items():
        if (row.kind is Loads.NEEDS_GPU) != (row.on_gpu is not None):
            problems.append(f"{name}: on_gpu is set exactly when the format needs a GPU")
        if row.on_gpu not in (None, Loads.SERVES, Loads.REFUSES):
            problems.append(f"{name}: a GPU run proves the format serves or refuses")
    return problems


def refusal(conversion: str, load_format: str, table: Mapping[str, Row], engine: str) -> str | None:
    """The one line refusing ``--load-format load_format`` on ``conversion``, or None where it may go on:
    a ``REFUSES`` row, or a format the table does not know (a newer release's, another plugin's)."""
    row = table.get(load_format)
    if row is not None and row.kind is not Loads.REFUSES:
        return None
    why = row.why if row is not None else "is no format this megamoe-convert release knows to serve a conversion"
    return (f"{conversion}: a megamoe-convert conversion cannot be served with {engine}'s --load-format {load_format}: "
            f"it {why}; serve it with --load-format {LOAD_FORMAT} (or auto)")
