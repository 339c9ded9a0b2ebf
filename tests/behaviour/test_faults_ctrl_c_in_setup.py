"""Ctrl-C (a KeyboardInterrupt at any point) during ``initialize`` or ``deinitialize`` leaves nothing behind once
a second ``deinitialize()`` ran (robustness follow-up of issues 20/22): no global registration hook, no patched
``Optimizer.zero_grad``, grad mode as it was, fp32 params. The interrupt is injected deterministically right
after (or inside) the steps that act before their undo is known: the registration-hook install, a patch, the
grad-mode toggles of ``torch.no_grad()``, each undo step and the session hand-over; then a randomized timer
test as a Ctrl-C at varying points would land.
"""
import logging
import signal
import threading

import pytest
import torch
from torch.nn.modules import module as module_mod

import amp_patch
from amp_patch.patching.patcher import Patcher
from amp_patch.session import state as _state

LEVELS = ("O1", "O2", "O3")
ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _net():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _hooks():
    return (dict(module_mod._global_module_registration_hooks),
            dict(module_mod._global_parameter_registration_hooks))


def _assert_clean(model, hooks_before, opt=None):
    assert _state.current() is None
    if opt is not None:  # the optimizer holds the model's params again (not fp32 masters)
        assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert torch.is_grad_enabled(), "grad mode left off"
    assert torch.optim.Optimizer.zero_grad is ZERO_GRAD, "Optimizer.zero_grad left patched"
    assert _hooks() == hooks_before, "a global registration hook leaked"
    assert all(p.dtype is torch.float32 for p in model.parameters())


def _interrupt_after(monkeypatch, owner, name, n=1):
    """``owner.name`` does its work, then raises KeyboardInterrupt on its n-th call (as a Ctrl-C right after it)."""
    original, calls = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(owner, name, interrupted)


def _initialize_interrupted(level, arm=None):
    """initialize interrupted (``arm()``, if given, sets the interrupt up once the model is built)."""
    model, opt = _net()
    hooks = _hooks()
    if arm is not None:
        arm()
    with pytest.raises(KeyboardInterrupt):
        amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    amp_patch.deinitialize()  # (a no-op where the failed initialize undid everything)
    return model, hooks, opt


@pytest.mark.parametrize("name", ["__init__", "attach"])
def test_ctrl_c_right_after_the_masters_went_into_the_optimizer(monkeypatch, name):
    """O2's OptimizerState put the fp32 masters into param_groups, then Ctrl-C: the model params go back."""
    from amp_patch.scaling.optimizer_state import OptimizerState
    _interrupt_after(monkeypatch, OptimizerState, name)
    model, hooks, opt = _initialize_interrupted("O2")
    monkeypatch.undo()
    _assert_clean(model, hooks, opt)


def test_ctrl_c_right_after_the_compute_copies_were_attached(monkeypatch):
    """O2's ComputeCopies hooked the model, then Ctrl-C: the hooks go, the params were never replaced."""
    from amp_patch.weights.compute_copies import ComputeCopies
    _interrupt_after(monkeypatch, ComputeCopies, "attach")
    model, hooks, opt = _initialize_interrupted("O2")
    monkeypatch.undo()
    _assert_clean(model, hooks, opt)


@pytest.mark.parametrize("name", ["register_module_module_registration_hook",
                                  "register_module_parameter_registration_hook"])
def test_ctrl_c_right_after_a_registration_hook_is_installed(monkeypatch, name):
    """The hook is in torch's global dict but its handle never reached amp_patch: it is removed all the same."""
    _interrupt_after(monkeypatch, module_mod, name)
    model, hooks, opt = _initialize_interrupted("O2")
    monkeypatch.undo()
    _assert_clean(model, hooks, opt)


@pytest.mark.parametrize("level,n", [("O1", 1), ("O1", 2), ("O1", 40), ("O2", 1), ("O3", 1)])
def test_ctrl_c_right_after_a_patch_is_installed(monkeypatch, level, n):
    """Patcher.install's n-th call patched its attribute, then Ctrl-C (O1's first: Optimizer.zero_grad)."""
    _interrupt_after(monkeypatch, Patcher, "install", n)
    model, hooks, opt = _initialize_interrupted(level)
    monkeypatch.undo()
    _assert_clean(model, hooks, opt)


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.proj(x)


def _patches_of(action):
    """The patcher of each patch ``action()`` applies, in order (a dry run)."""
    seen, original = [], Patcher._apply

    def recording(self, patch):
        seen.append(id(self))
        return original(self, patch)

    Patcher._apply = recording
    try:
        action()
    finally:
        Patcher._apply = original
    return seen


def _each_patchers_first_and_last(seen):
    firsts = {seen.index(owner) for owner in seen}
    lasts = {len(seen) - 1 - seen[::-1].index(owner) for owner in seen}
    return sorted(firsts | lasts), len(firsts)


@pytest.mark.parametrize("level", ["O0", *LEVELS])
def test_ctrl_c_right_after_each_patchers_first_and_last_patch_leaves_nothing_behind(monkeypatch, level):
    """Every patcher of initialize (every step that patches, the forward guard of each model class included) is
    interrupted right after its first and after its last patch: a deinitialize then leaves no patch registered."""
    from amp_patch.patching import registry
    model, opt = _net()
    models = [model, _Head()]
    hooks = _hooks()
    seen = _patches_of(lambda: amp_patch.initialize(models, opt, opt_level=level, verbosity=0))
    amp_patch.deinitialize()
    indices, patchers = _each_patchers_first_and_last(seen)
    assert patchers >= 2 and not registry.installed()
    for index in indices:
        _interrupt_after(monkeypatch, Patcher, "_apply", index + 1)
        with pytest.raises(KeyboardInterrupt):
            amp_patch.initialize(models, opt, opt_level=level, verbosity=0)
        monkeypatch.undo()
        amp_patch.deinitialize()
        assert not registry.installed(), f"interrupted after patch {index + 1} of {len(seen)}"
        _assert_clean(model, hooks, opt)


def test_ctrl_c_right_after_each_patchers_first_and_last_patch_as_a_region_opens_leaves_nothing_behind(monkeypatch):
    """``amp_patch.autocast()`` interrupted as it opens, right after each of its patchers' first and last patch."""
    from amp_patch.patching import registry

    def open_and_close():
        with amp_patch.autocast():
            pass
    indices, patchers = _each_patchers_first_and_last(_patches_of(open_and_close))
    assert patchers >= 2 and not registry.installed()
    for index in indices:
        _interrupt_after(monkeypatch, Patcher, "_apply", index + 1)
        with pytest.raises(KeyboardInterrupt):
            open_and_close()
        monkeypatch.undo()
        assert not registry.installed(), f"interrupted after patch {index + 1}"
        assert not torch.is_autocast_enabled("cpu")


class _Flaky:
    """Sets the attribute, then raises KeyboardInterrupt once for the names in ``interrupt``."""
    interrupt = set()

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name in self.interrupt:
            self.interrupt.discard(name)
            raise KeyboardInterrupt


def test_ctrl_c_inside_a_patch_install_or_restore_after_the_attribute_was_set(caplog):
    target, patcher = _Flaky(), Patcher()
    object.__setattr__(target, "a", "original")
    _Flaky.interrupt = {"a"}
    with pytest.raises(KeyboardInterrupt):  # set to "patched", then interrupted: put back
        patcher.install(target, "a", lambda original: "patched")
    assert target.a == "original" and len(patcher) == 0
    patcher.install(target, "a", lambda original: "patched")
    _Flaky.interrupt = {"a"}
    with pytest.raises(KeyboardInterrupt):  # set back to "original", then interrupted: kept for the retry
        patcher.restore_all()
    assert target.a == "original" and len(patcher) == 1
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        assert patcher.restore_all() == 1 and len(patcher) == 0
    assert "re-patched" not in caplog.text  # the attribute is the original: nobody re-patched it


def _no_grad_interrupted(monkeypatch, which):
    """torch.no_grad().__enter__ turns grads off, or __exit__ does not turn them back on, then Ctrl-C (once)."""
    no_grad, done = torch.no_grad, []
    original = getattr(no_grad, which)

    def interrupted(self, *args):
        if done:
            return original(self, *args)
        done.append(1)
        if which == "__enter__":
            original(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(no_grad, which, interrupted)


@pytest.mark.parametrize("which", ["__enter__", "__exit__"])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_ctrl_c_inside_no_grad_while_undoing_an_interrupted_initialize_leaves_grads_on(monkeypatch, which, level):
    """Ctrl-C after the casting step, and again inside a no_grad() of the undo that follows."""
    from amp_patch.session import api as frontend

    def arm():
        _interrupt_after(monkeypatch, frontend, "_install_casting")
        _no_grad_interrupted(monkeypatch, which)

    model, hooks, opt = _initialize_interrupted(level, arm)
    assert torch.is_grad_enabled()
    monkeypatch.undo()
    _assert_clean(model, hooks, opt)


# Deinitialize enters no_grad() where it writes weights: the two-copy masters carry the half params' last edits.
# Default O2 (one owner) and O3 keep no second copy, write no weight at deinitialize and enter no no_grad() there.
DEINIT_NO_GRAD = {"O2 split": dict(opt_level="O2", half_dtype=torch.bfloat16, master_rounding="split")}


@pytest.mark.parametrize("which", ["__enter__", "__exit__"])
@pytest.mark.parametrize("level", list(DEINIT_NO_GRAD))
def test_ctrl_c_inside_no_grad_during_deinitialize_leaves_grads_on(monkeypatch, which, level):
    model, opt = _net()
    hooks = _hooks()
    amp_patch.initialize(model, opt, verbosity=0, **DEINIT_NO_GRAD[level])
    _no_grad_interrupted(monkeypatch, which)
    with pytest.raises(KeyboardInterrupt):
        amp_patch.deinitialize()
    assert torch.is_grad_enabled()
    monkeypatch.undo()
    amp_patch.deinitialize()
    _assert_clean(model, hooks, opt)


def test_deinitialize_leaves_the_grad_mode_it_was_called_in():
    model, opt = _net()
    amp_patch.initialize(model, opt, opt_level="O2", verbosity=0)
    with torch.no_grad():
        amp_patch.deinitialize()
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("level", LEVELS)
def test_ctrl_c_in_each_undo_step_then_a_second_deinitialize_finishes(level):
    """Every undo step in turn is interrupted after it ran (the worst case: a retry runs it again)."""
    model, opt = _net()
    hooks = _hooks()
    amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    count = len(_state.current().undo)
    amp_patch.deinitialize()
    for index in range(count):
        amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
        session = _state.current()
        step = session.undo[index]

        def interrupted(step=step, raised=[]):  # noqa: B006 - the list is the once-flag kept across calls
            step()
            if not raised:  # once: the retry runs the step again, uninterrupted
                raised.append(1)
                raise KeyboardInterrupt

        session.undo[index] = interrupted
        with pytest.raises(KeyboardInterrupt):
            amp_patch.deinitialize()
        assert _state.current() is session
        amp_patch.deinitialize()
        _assert_clean(model, hooks, opt)


def test_ctrl_c_as_deinitialize_hands_the_session_over_keeps_it_for_the_retry(monkeypatch):
    """The session is no longer current but not closed yet: it must not be lost (nothing could undo it then)."""
    model, opt = _net()
    hooks = _hooks()
    amp_patch.initialize(model, opt, opt_level="O2", verbosity=0)
    session = _state.current()
    _interrupt_after(monkeypatch, _state, "deactivate")
    with pytest.raises(KeyboardInterrupt):
        amp_patch.deinitialize()
    monkeypatch.undo()
    assert _state.current() is session
    amp_patch.deinitialize()
    _assert_clean(model, hooks, opt)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("phase", ["initialize", "deinitialize"])
def test_ctrl_c_from_a_timer_at_varying_points(phase):
    """A KeyboardInterrupt from SIGALRM at 10 us .. 1 ms into initialize or deinitialize, 400 times."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals need the main thread")
    model, opt = _net()
    hooks = _hooks()

    def ctrl_c(*args):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        for i in range(400):
            if phase == "deinitialize":
                amp_patch.initialize(model, opt, opt_level="O2", verbosity=0)
            try:
                signal.setitimer(signal.ITIMER_REAL, (i % 100 + 1) * 1e-5)
                if phase == "initialize":
                    amp_patch.initialize(model, opt, opt_level="O2", verbosity=0)
                amp_patch.deinitialize()
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                pass
            finally:
                _cancel_timer()
            amp_patch.deinitialize()  # docs: a second call finishes the job
            _assert_clean(model, hooks, opt)
    finally:
        _cancel_timer()
        signal.signal(signal.SIGALRM, old)
        amp_patch.deinitialize()


def _cancel_timer():
    while True:  # the timer may fire as it is cancelled: cancel until it did not
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        except KeyboardInterrupt:
            continue
