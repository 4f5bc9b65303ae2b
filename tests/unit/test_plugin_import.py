"""Each engine's plugin is imported by every process of the engine (vLLM's API server, engine core and
workers; SGLang's every process, through ``load_plugins``), most of which never load a conversion: its
import leaves what only a conversion's load needs unimported."""

from __future__ import annotations

import importlib
import sys

import pytest

#: Modules a conversion's load imports at its first use, never the plugin's import.
LOADED_AT_FIRST_USE = ("megamoe_convert.engines.driver", "megamoe_convert.engines.probe",
                       "megamoe_convert.layout.identity", "megamoe_convert.serve.staging",
                       "megamoe_convert.serve.store", "megamoe_convert.output.manifest",
                       "megamoe_convert.source.families", "megamoe_convert.source.engines_table",
                       "megamoe_convert.engines.format_matrix", "megamoe_convert.engines.vllm.installing",
                       "megamoe_convert.engines.sglang.installing", "megamoe_convert.engines.sglang.recovery",
                       "megamoe_convert.engines.sglang.presharded", "megamoe_convert.engines.sglang.weight_cache")

#: What an engine's registration needs: SGLang's load-format table is registered with its hooks.
REGISTERED_AT_START = {"sglang": {"megamoe_convert.engines.format_matrix"}}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_plugins_import_leaves_a_loads_modules_unimported(engine):
    saved = dict(sys.modules)
    try:  # the package imported afresh, as in a new process; the session's modules put back after
        for name in [m for m in sys.modules if m == "megamoe_convert" or m.startswith("megamoe_convert.")]:
            del sys.modules[name]
        importlib.import_module(f"megamoe_convert.engines.{engine}.plugin")
        imported = {m for m in sys.modules if m.startswith("megamoe_convert.")}
    finally:
        sys.modules.clear()
        sys.modules.update(saved)
    assert f"megamoe_convert.engines.{engine}.model_classes" in imported  # the plugin's own modules did load
    later = set(LOADED_AT_FIRST_USE) - REGISTERED_AT_START.get(engine, set())
    assert not imported & later, sorted(imported & later)
