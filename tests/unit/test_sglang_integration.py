"""The SGLang engine module without SGLang: names, registration, and the entry point. (Against
SGLang's real code: tests/engines/test_sglang_*.py, run by tests/test_engines_real.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megamoe_convert.engines.sglang.experts import layer_key
from megamoe_convert.engines.sglang.plugin import register
from megamoe_convert.errors import InstallError


def test_layer_keys_map_sglang_prefixes_to_checkpoint_layers():
    assert layer_key("model.layers.7.mlp.experts") == "layers.7"
    assert layer_key("model.decoder.mlp.experts") == "mtp.0"  # the NextN draft model's one MTP layer
    with pytest.raises(InstallError, match="model.layers.7.ffn.experts: not a MegaMoE experts prefix"):
        layer_key("model.layers.7.ffn.experts")


def test_register_is_a_no_op_without_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    register()


def test_entry_point_is_declared():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.plugins"]' in text
    assert 'megamoe = "megamoe_convert.engines.sglang.plugin:register"' in text
