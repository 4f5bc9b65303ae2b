"""The vLLM plugin is imported by every vLLM process (the API server, the engine core, each worker),
most of which never load a conversion: its import leaves what only a conversion's load needs
unimported."""

from __future__ import annotations

import importlib
import sys

#: Modules a conversion's load imports at its first use, never the plugin's import.
LOADED_AT_FIRST_USE = ("megamoe_convert.engines.driver", "megamoe_convert.engines.probe",
                       "megamoe_convert.layout.identity", "megamoe_convert.serve.staging",
                       "megamoe_convert.serve.store", "megamoe_convert.output.manifest",
                       "megamoe_convert.source.families", "megamoe_convert.source.engines_table",
                       "megamoe_convert.engines.format_matrix")


def test_the_plugins_import_leaves_a_loads_modules_unimported():
    saved = dict(sys.modules)
    try:  # the package imported afresh, as in a new process; the session's modules put back after
        for name in [m for m in sys.modules if m == "megamoe_convert" or m.startswith("megamoe_convert.")]:
            del sys.modules[name]
        importlib.import_module("megamoe_convert.engines.vllm.plugin")
        imported = {m for m in sys.modules if m.startswith("megamoe_convert.")}
    finally:
        sys.modules.clear()
        sys.modules.update(saved)
    assert "megamoe_convert.engines.vllm.model_classes" in imported  # the plugin's own modules did load
    assert not imported & set(LOADED_AT_FIRST_USE), sorted(imported & set(LOADED_AT_FIRST_USE))
