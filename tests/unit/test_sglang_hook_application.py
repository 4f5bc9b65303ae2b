"""``engines/sglang/hooks.py`` on modules of its own making: a target whose module is imported is
hooked at once; any other the moment its module is imported, before its importer binds a name from
it; functions re-pointed where they were imported by name; nothing wrapped twice; a missing target
logged and left. (In SGLang's real modules: tests/engines/test_sglang_hooks.py.)"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

import pytest

from megamoe_convert.engines.sglang import hooks

SOURCE = '''
def add(a, b):
    return a + b


class Model:
    def load_weights(self, weights):
        return list(weights)

    @staticmethod
    def build(n):
        return n
'''


def around_add(add, a, b):
    return add(a, b) + 100


def around_load(load_weights, model, weights):
    return ["hooked", *load_weights(model, weights)]


def around_build(build, n):
    return build(n) * 10


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package with ``target`` and ``user``, which imports ``add`` by name; neither imported
    yet. Its name stands for SGLang's prefix (the modules where bindings are re-pointed)."""
    name = f"hooktest_{len(sys.modules)}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "target.py").write_text(SOURCE)
    (tmp_path / name / "user.py").write_text(f"from {name}.target import add\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hooks, "SGLANG_PREFIX", f"{name}.")
    yield name
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]


def hooks_of(name):
    return [(f"{name}.target.add", around_add), (f"{name}.target.Model.load_weights", around_load),
            (f"{name}.target.Model.build", around_build)]


def test_a_module_imported_later_is_hooked_before_its_importer_binds_a_name(package):
    hooks.around(hooks_of(package))
    assert f"{package}.target" not in sys.modules  # nothing imported to hook it
    user = importlib.import_module(f"{package}.user")
    target = sys.modules[f"{package}.target"]
    assert user.add(1, 2) == target.add(1, 2) == 103
    assert target.Model().load_weights([1]) == ["hooked", 1] and target.Model.build(2) == 20
    assert package + ".target" not in hooks.AfterImport.install().pending  # nothing left to wait for


def test_an_imported_module_is_hooked_now_and_its_bindings_re_pointed_once(package):
    user = importlib.import_module(f"{package}.user")
    hooks.around(hooks_of(package))
    hooks.around(hooks_of(package))  # a second registration wraps nothing twice
    target = sys.modules[f"{package}.target"]
    assert user.add(1, 2) == 103 and target.Model().load_weights([]) == ["hooked"] and target.Model.build(1) == 10
    assert not hooks.hooked(target.add.__wrapped__, around_add)
    assert hooks.hooked(target.Model.load_weights, around_load) and hooks.hooked(target.add, around_add)


def test_a_target_its_module_lacks_is_logged_and_left(package, caplog, monkeypatch):
    monkeypatch.setattr(hooks, "MISSING", {})
    importlib.import_module(f"{package}.target")
    with caplog.at_level(logging.WARNING, logger=hooks.__name__):
        hooks.around([(f"{package}.target.gone", around_add), (f"{package}.target.Model.gone", around_load)])
    assert set(hooks.MISSING) == {f"{package}.target.gone", f"{package}.target.Model.gone"}
    assert "target.gone not found in this SGLang" in caplog.text


@pytest.mark.parametrize("target,module", [("a.b.f", "a.b"), ("a.b.Cls.m", "a.b"), ("a.b.c.Cls.m", "a.b.c")])
def test_a_target_s_module(target, module):
    assert hooks.module_of(target) == module


def test_a_module_run_apart_from_the_import_system_leaves_the_hooks_waiting(package):
    """``importlib.util.find_spec`` + ``exec_module`` by hand (a copy outside ``sys.modules``) is not the
    import to hook: the hooks still wait for it."""
    hooks.around(hooks_of(package))
    spec = importlib.util.find_spec(f"{package}.target")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.add(1, 2) == 3 and f"{package}.target" in hooks.AfterImport.install().pending
    assert importlib.import_module(f"{package}.target").add(1, 2) == 103


def test_another_finder_that_asks_the_others_finds_the_spec_without_a_loop(package, monkeypatch):
    """A finder on ``sys.meta_path`` that, like ours, asks the others (ours included): ours answers
    nothing while it is itself asking, so the two never call each other without end."""
    class AsksTheOthers:
        def find_spec(self, name, path, target=None):
            return next((spec for finder in list(sys.meta_path) if finder is not self and hasattr(finder, "find_spec")
                         and (spec := finder.find_spec(name, path, target)) is not None), None)

    monkeypatch.setattr(sys, "meta_path", [AsksTheOthers(), *sys.meta_path])
    hooks.around(hooks_of(package))
    spec = importlib.util.find_spec(f"{package}.target")
    assert getattr(spec.loader.exec_module, "_megamoe_after", None) is hooks.AfterImport.install()
    assert importlib.import_module(f"{package}.user").add(1, 2) == 103


def test_a_wrapper_that_cannot_be_weakly_referenced_still_leads_to_ours(package):
    class Slotted:
        __slots__ = ("__wrapped__",)

        def __init__(self, wrapped):
            self.__wrapped__ = wrapped

    target = importlib.import_module(f"{package}.target")
    hooks.around(hooks_of(package))
    outer = Slotted(target.add)
    assert hooks.hooked(outer, around_add)
