"""The patcher on dummy targets: exact restore of own and inherited attributes, reverse order, misuse."""
import logging
import types

import pytest
from tests_support import leaks_of

from amp_patch.errors import PatchError
from amp_patch.patching.patcher import Patcher


class Base:
    def inherited(self):
        return "base"

    @staticmethod
    def static():
        return "static"


class Child(Base):
    def own(self):
        return "own"


def _wrap(tag):
    def make(original):
        def wrapper(*args, **kwargs):
            return (tag, original(*args, **kwargs))
        return wrapper
    return make


def test_inherited_method_is_deleted_not_overwritten():
    patcher = Patcher()
    before = dict(vars(Child))
    patcher.install(Child, "inherited", _wrap("w"))
    assert "inherited" in vars(Child)
    assert Child().inherited() == ("w", "base")
    patcher.restore_all()
    assert "inherited" not in vars(Child), "restoring an inherited attribute must delattr, not setattr"
    assert dict(vars(Child)) == before
    assert Child().inherited() == "base"


def test_own_attribute_gets_the_identical_object_back():
    patcher = Patcher()
    raw = vars(Child)["own"]
    patcher.install(Child, "own", _wrap("w"))
    patcher.restore_all()
    assert vars(Child)["own"] is raw


def test_staticmethod_raw_descriptor_is_restored():
    patcher = Patcher()
    raw = vars(Base)["static"]
    patcher.install(Base, "static", lambda original: staticmethod(lambda: ("w", original())))
    assert Base.static() == ("w", "static")
    patcher.restore_all()
    assert vars(Base)["static"] is raw and isinstance(raw, staticmethod)


def test_module_attribute_round_trip_and_reverse_order():
    mod = types.ModuleType("dummy")
    mod.f = lambda: 1
    mod.g = lambda: 2
    original_f, original_g = mod.f, mod.g
    order = []
    patcher = Patcher()
    patcher.install(mod, "f", _wrap("f"))
    patcher.install(mod, "g", _wrap("g"))
    assert mod.f() == ("f", 1) and mod.g() == ("g", 2)
    real_restore = patcher._restore
    patcher._restore = lambda patch: order.append(patch.name) or real_restore(patch)
    assert patcher.restore_all() == 2
    assert order == ["g", "f"]
    assert mod.f is original_f and mod.g is original_g


def test_patching_the_same_site_twice_is_refused():
    mod = types.ModuleType("dummy")
    mod.f = lambda: 1
    patcher = Patcher()
    patcher.install(mod, "f", _wrap("a"))
    with pytest.raises(PatchError, match="already patched"):
        patcher.install(mod, "f", _wrap("b"))
    patcher.restore_all()


def test_missing_attribute_is_a_patch_error():
    with pytest.raises(PatchError, match="does not exist"):
        Patcher().install(types.ModuleType("dummy"), "nope", _wrap("x"))


def test_foreign_repatch_is_left_alone_with_a_warning(caplog):
    mod = types.ModuleType("dummy")
    mod.f = lambda: 1
    patcher = Patcher()
    patcher.install(mod, "f", _wrap("ours"))
    theirs = lambda: "theirs"  # noqa: E731
    mod.f = theirs
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        patcher.restore_all()
    assert mod.f is theirs
    assert "re-patched" in caplog.text and "dummy.f" in caplog.text


def test_leak_detector_sees_a_leftover_and_a_shadowing_entry():
    class Target(Base):
        pass

    snapshot = {id(Target): (Target, dict(vars(Target)))}
    Target.inherited = Base.inherited  # the classic wrong undo: setattr of the inherited value
    assert leaks_of(snapshot) == ["Target.inherited"]
    del Target.inherited
    assert leaks_of(snapshot) == []
