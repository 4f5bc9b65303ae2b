"""The plugin's hooks in SGLang's real modules (``engines/sglang/hooks.py``): applied as SGLang's
``HookRegistry`` applies them, without its walk of every module per target; each function's
by-name bindings in SGLang's modules re-pointed; a second registration wraps nothing twice; a target
this SGLang lacks is logged, and a conversion whose model class its hook missed is refused."""

from __future__ import annotations

import ast
import logging
import os
import pkgutil
import subprocess
import sys
import types
from unittest import mock

import pytest
import sglang_harness as h
from sglang_model_classes_harness import parsed, plugins

from megamoe_convert.engines.sglang import hooks, model_classes, plugin
from megamoe_convert.errors import InstallError


def test_hook_registry_walks_for_none_of_the_plugin_s_targets():
    """``HookRegistry.apply_hooks`` walks every module's every attribute once per registered target:
    the plugin registers none there, and every one of its targets is wrapped all the same."""
    from sglang.srt.plugins import hook_registry

    plugins()
    ours = {target for target, _ in model_classes.HOOKS} | {t for t, _, _ in plugin.AT_FIRST_CALL}
    assert not ours & set(hook_registry.HookRegistry._hooks)
    for target, hook in model_classes.HOOKS:
        owner, name = target.rsplit(".", 1)
        assert hooks.hooked(getattr(pkgutil.resolve_name(owner), name), hook), target


def test_a_function_s_bindings_by_name_in_sglang_s_modules_are_re_pointed():
    from sglang.srt.configs import model_config
    from sglang.srt.model_loader import loader

    plugins()
    assert hooks.hooked(model_config.get_config, model_classes.config_around)  # `from ... import get_config`
    assert hooks.hooked(loader.get_model_architecture, model_classes.architecture_around)


def test_a_second_registration_wraps_nothing_twice():
    plugins()
    plugin.register()
    for cls in (h.DeepseekV4ForCausalLM,):
        wrapped = cls.__dict__["load_weights"].__wrapped__
        assert not hooks.hooked(wrapped, model_classes.load_weights_around) and not hasattr(wrapped, "__wrapped__")
    from sglang.srt.utils.hf_transformers import config

    assert not hooks.hooked(config.get_config.__wrapped__, model_classes.config_around)
    from sglang.srt.configs.load_config import LoadConfig

    verify = LoadConfig.__dict__["_verify_load_format"]
    assert not hasattr(verify.__wrapped__, "__wrapped__")  # the load format's route, wrapped once


def test_a_target_this_sglang_lacks_is_logged_and_left(caplog, monkeypatch):
    monkeypatch.setattr(hooks, "MISSING", {})
    calls = []
    plugins()
    with caplog.at_level(logging.WARNING, logger=hooks.__name__):
        hooks.around([("sglang.srt.model_loader.loader.no_such_function", lambda *a: calls.append(a))])
    assert set(hooks.MISSING) == {"sglang.srt.model_loader.loader.no_such_function"}
    assert "no_such_function not found in this SGLang" in caplog.text and not calls


#: A process that loads plugins before it imports SGLang's models (SGLang's launcher does, before it
#: starts the schedulers): registering imports none of the hooks' modules; importing one hooks it.
LAUNCHER = """
import sys
from megamoe_convert.engines.sglang import hooks, model_classes, plugin
plugin.register()
held = sorted(m for m in (hooks.module_of(t) for t, _ in model_classes.HOOKS) if m in sys.modules)
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
from sglang.srt.configs.model_config import get_config
print("HELD", held)
print("HOOKED", hooks.hooked(Qwen3MoeForCausalLM.load_weights, model_classes.load_weights_around),
      hooks.hooked(get_config, model_classes.config_around))
"""


def test_registering_imports_no_model_module_and_an_import_hooks_it():
    out = subprocess.run([sys.executable, "-c", h.TORCHVISION_STAND_IN + LAUNCHER], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("HELD", "HOOKED")))
    assert not any(".models." in m for m in ast.literal_eval(lines["HELD"])), lines
    assert lines["HOOKED"] == "True True", out.stdout


def test_a_conversion_whose_model_class_lost_its_hook_is_refused(sglang_converted):
    """A newer SGLang whose model class defines ``load_weights`` where the plugin's hook is not (a
    subclass, a moved method) would feed the conversion to an unhooked ``load_weights``: no expert
    installed, zeros served. ``get_model_architecture`` refuses it first."""
    from sglang.srt.configs.model_config import ModelImpl
    from sglang.srt.model_loader import utils

    hf_config = parsed(sglang_converted)
    config = types.SimpleNamespace(model_path=str(sglang_converted), revision=None, hf_config=hf_config,
                                   hf_text_config=hf_config, quantization=None, is_generation=True,
                                   is_multimodal=False, model_impl=ModelImpl.AUTO)
    cls = h.DeepseekV4ForCausalLM
    with mock.patch.object(cls, "load_weights", cls.__dict__["load_weights"].__wrapped__):
        with pytest.raises(InstallError, match="DeepseekV4ForCausalLM.load_weights of this SGLang is not the one "
                                               "megamoe-convert hooks"):
            utils.get_model_architecture(config)
    assert utils.get_model_architecture(config)[0] is cls  # hooked again: served


def test_a_conversion_is_refused_where_another_plugin_replaces_a_target_of_ours(sglang_converted, monkeypatch):
    """SGLang applies another plugin's ``REPLACE`` around our hook: what it replaces, our install
    included, never runs, and the copied attributes of the wrapper would not tell."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    plugins()
    target = model_classes.LOAD_WEIGHTS[0]
    monkeypatch.setitem(HookRegistry._hooks, target, [(HookType.REPLACE, lambda *a, **k: None, None)])
    with pytest.raises(InstallError, match=f"another SGLang plugin replaces {target}, where megamoe-convert installs"):
        parsed(sglang_converted)


def test_a_conversion_is_refused_where_this_sglang_lacks_a_gate(sglang_converted, monkeypatch):
    plugins()
    gate = next(iter(model_classes.GATES))
    monkeypatch.setitem(hooks.MISSING, gate, "AttributeError: moved")
    with pytest.raises(InstallError, match=f"megamoe-convert's hook of {gate} is not in place in this SGLang"):
        parsed(sglang_converted)


def test_a_conversion_is_refused_where_a_gate_is_not_in_place(sglang_converted, monkeypatch):
    """A gate whose hook did not land (its module hooked while half-imported, say) though nothing
    recorded it missing: the gate's function as it stands is checked."""
    from sglang.srt.model_loader import loader

    plugins()
    monkeypatch.setattr(loader, "get_model_loader", loader.get_model_loader.__wrapped__)
    with pytest.raises(InstallError, match="hook of sglang.srt.model_loader.loader.get_model_loader is not in place"):
        parsed(sglang_converted)
