"""A failed initialize and an interrupted deinitialize leave nothing behind.

A fault is injected after (and inside) every step of ``initialize``; the models, optimizers, torch's
namespaces and global hooks, and amp_patch's own state must then be exactly as before, bitwise. A fault in one
undo step of ``deinitialize`` must not stop the others, and a second ``deinitialize()`` must finish the job.
"""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules import module as module_mod

import amp_patch
from amp_patch.casting.engine import CastingEngine
from amp_patch.model.transform import ModelPatch
from amp_patch.parallel import ddp as distributed
from amp_patch.patching.patcher import Patcher
from amp_patch.session import api as frontend
from amp_patch.session import state as _state
from amp_patch.session.session import Session
from amp_patch.weights.compute_copies import ComputeCopies

LEVELS = ("O1", "O2", "O3")
# every step of initialize that changes something (frontend's names), faulted right after it ran
STEPS = ("_prepare_models", "attach_optimizer_states", "_guard_zero_grad", "link_masters", "_install_casting",
         "_reach_early_bound", "_attach_scopes", "_guard_step_pause", "_set_up_diagnostics",
         "_log_configuration")
NAMESPACES = (torch, F, torch.Tensor, torch._C.TensorBase, torch._VF, torch.optim.Optimizer, torch.optim.SGD,
              torch.nn.parallel.DistributedDataParallel, torch.nn.modules.rnn.RNNBase)
GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_module_registration_hooks",
                "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")
MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                "_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_backward_hooks")


class Fault(Exception):
    pass


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 2)
        self.act = F.relu  # an early-bound function (O1 reroutes it)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 6) / 3)

    def forward(self, x):
        return self.head(self.act(self.bn(self.lin(x)) + self.shift))


def _trained():
    """A model and an SGD-with-momentum optimizer that has state (one plain fp32 step)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    return model, opt


def _tensor_key(t):
    if t is None:
        return None
    return (id(t), t.dtype, t.shape, t.requires_grad, t.detach().flatten().view(torch.uint8).clone()
            if t.numel() else None)


def _snapshot(model, opt):
    tensors = {name: (_tensor_key(t), _tensor_key(t.grad) if t.grad is not None else None, t.data.data_ptr())
               for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    hooks = {(name, attr): list(getattr(m, attr, {}).values()) for name, m in model.named_modules()
             for attr in MODULE_HOOKS}
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    state = {id(p): {k: _tensor_key(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in opt.state.items()}
    opt_hooks = (list(opt._optimizer_step_pre_hooks.values()), list(opt._optimizer_step_post_hooks.values()))
    spaces = {getattr(ns, "__name__", repr(ns)): dict(vars(ns)) for ns in NAMESPACES}
    globals_ = {name: list(getattr(module_mod, name).values()) for name in GLOBAL_HOOKS}
    logger = list(logging.getLogger("amp_patch").filters)
    return dict(tensors=tensors, hooks=hooks, groups=groups, state=state, opt_hooks=opt_hooks, act=model.act,
                globals=globals_, logger=logger, amp=(_state.current(), _state.active_engine()), spaces=spaces)


def _assert_same(before, after):
    for key in before:
        if key == "spaces":
            for ns, old in before[key].items():
                now = after[key][ns]
                changed = [k for k in set(old) | set(now) if old.get(k) is not now.get(k) and k != "__slotnames__"]
                assert not changed, f"{ns}: {changed}"
        else:
            assert _equal(before[key], after[key]), f"{key} differs after the failed initialize"


def _equal(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a is b or a == b


def _fault_after(monkeypatch, owner, name):
    original = getattr(owner, name)

    def faulty(*args, **kwargs):
        original(*args, **kwargs)
        raise Fault(name)

    monkeypatch.setattr(owner, name, faulty)


def _fault_on_call(monkeypatch, owner, name, n):
    """``owner.name`` raises on its n-th call (after n-1 calls that did their work)."""
    original, calls = getattr(owner, name), []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise Fault(f"{name} call {n}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)


def _check_initialize_leaves_nothing(level, exc=Fault, **kwargs):
    model, opt = _trained()
    before = _snapshot(model, opt)
    with pytest.raises(exc):
        amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=1, **kwargs)
    _assert_same(before, _snapshot(model, opt))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("step", STEPS)
def test_fault_after_each_initialize_step_leaves_everything_as_before(monkeypatch, level, step):
    _fault_after(monkeypatch, frontend, step)
    _check_initialize_leaves_nothing(level, diagnose_overflow=True)


INNER = [  # (owner, name, n-th call that raises, the levels that call it)
    (ComputeCopies, "attach", 1, ("O2",)), (ModelPatch, "cast_io", 1, ("O2", "O3")),
    (ModelPatch, "link_state_dict", 1, ("O2", "O3")), (Patcher, "install", 40, ("O1",)),
    (Patcher, "install", 1, ("O2",)), (Patcher, "install", 1, ("O3",)),
    (CastingEngine, "install", 1, ("O1",)), (distributed, "install_rank_filter", 1, LEVELS),
    (_state, "activate", 1, LEVELS)]  # (the activation in _commit: the last step that can fail)
INNER_CASES = [pytest.param(owner, name, n, level, id=f"{owner.__name__}.{name}{n}-{level}")
               for owner, name, n, levels in INNER for level in levels]


@pytest.mark.parametrize("owner,name,n,level", INNER_CASES)
def test_fault_inside_initialize_steps_leaves_everything_as_before(monkeypatch, owner, name, n, level):
    _fault_on_call(monkeypatch, owner, name, n)
    _check_initialize_leaves_nothing(level)


def test_fault_midway_through_casting_the_weights(monkeypatch):
    """The third weight's cast fails: the first two get their very fp32 data back (not a rounded upcast)."""
    calls = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        if kwargs.get("dtype") is torch.bfloat16 or torch.bfloat16 in args:
            calls.append(1)
            if len(calls) == 3:
                raise Fault("cast")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    model, opt = _trained()
    before = _snapshot(model, opt)
    with pytest.raises(Fault):
        amp_patch.initialize(model, opt, opt_level="O3", half_dtype=torch.bfloat16, verbosity=0)
    assert len(calls) >= 3  # (the restore of the cast buffer compares it with its fp32 data in bf16)
    _assert_same(before, _snapshot(model, opt))


@pytest.mark.parametrize("bad", [dict(num_losses=0), dict(history_size=0), dict(growth_interval=0),
                                 dict(op_lists="no_such_list"), dict(hysteresis=-1), dict(backoff_factor=2.0)])
@pytest.mark.parametrize("level", LEVELS)
def test_config_error_leaves_the_model_untouched(monkeypatch, level, bad):
    """Checked before the model is cast: the fp32 weights are not rounded to half (they were at O3)."""
    for name in ("cast", "cast_io"):  # not even touched and undone: checked before
        monkeypatch.setattr(ModelPatch, name, lambda *a, **k: pytest.fail("the model was touched"))
    monkeypatch.setattr(distributed, "install_rank_filter", lambda *a: pytest.fail("the logger was touched"))
    if "op_lists" in bad and level != "O1":
        bad = dict(bad, op_lists="torch_cpu")  # op_lists at O2/O3 is itself the mistake
    _check_initialize_leaves_nothing(level, exc=ValueError, **bad)


def test_keyboard_interrupt_during_initialize_leaves_nothing(monkeypatch):
    original = frontend.link_masters

    def interrupted(session):
        original(session)
        raise KeyboardInterrupt

    monkeypatch.setattr(frontend, "link_masters", interrupted)
    _check_initialize_leaves_nothing("O2", exc=KeyboardInterrupt)


# -- deinitialize ------------------------------------------------------------------------------------------
def _session_with_failing_undo(monkeypatch, level, failing, exc):
    """initialize, then make undo step ``failing`` (an index into session.undo, newest last) raise once."""
    model, opt = _trained()
    before = _snapshot(model, opt)
    amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    session = _state.current()
    index = failing % len(session.undo)
    step, raised = session.undo[index], []

    def once():
        if not raised:
            raised.append(1)
            raise exc("undo step")
        step()

    session.undo[index] = once
    return model, opt, before


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("failing", [0, 1, -2, -1])
@pytest.mark.parametrize("exc", [Fault, KeyboardInterrupt])
def test_interrupted_deinitialize_runs_every_other_step_and_a_retry_finishes(monkeypatch, level, failing, exc):
    model, opt, before = _session_with_failing_undo(monkeypatch, level, failing, exc)
    session = _state.current()
    with pytest.raises(exc):
        amp_patch.deinitialize()
    assert _state.current() is session and len(session.undo) == 1  # only the failed step is left to do
    amp_patch.deinitialize()
    assert _state.current() is None and not session.undo
    after = _snapshot(model, opt)
    for snap in (before, after):  # a deinitialized session's params are the masters (O2) or upcast (O3)
        snap["tensors"] = {k: v for k, v in snap["tensors"].items() if level == "O1"}
        snap["state"] = {k: {n: x for n, x in v.items() if level == "O1"} for k, v in snap["state"].items()}
    _assert_same(before, after)
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_session_close_keeps_the_failed_steps_in_order():
    session, done = Session(), []

    def fail():
        raise Fault("x")

    session.undo = [lambda: done.append("a"), fail, lambda: done.append("c"), fail]
    with pytest.raises(Fault):
        session.close()
    assert done == ["c", "a"] and session.undo == [fail, fail]


def test_a_failed_undo_of_a_failed_initialize_is_retried_by_deinitialize(monkeypatch, caplog):
    """initialize fails, then one of its undo steps fails too: the initialize error is the one raised, the session
    stays current (logged), and deinitialize() finishes the undo."""
    model, opt = _trained()
    before = _snapshot(model, opt)
    original_restore, calls = ModelPatch.restore, []

    def restore_fails_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("undo step")
        return original_restore(self, *args, **kwargs)

    monkeypatch.setattr(ModelPatch, "restore", restore_fails_once)
    _fault_after(monkeypatch, frontend, "_install_casting")
    with caplog.at_level(logging.ERROR, logger="amp_patch"), pytest.raises(Fault):
        amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    assert _state.current() is not None and "call amp_patch.deinitialize()" in caplog.text
    amp_patch.deinitialize()
    _assert_same(before, _snapshot(model, opt))


def test_an_interrupted_patch_restore_keeps_that_patch_for_the_retry():
    """Within one undo step (e.g. the O1 engine's hundreds of patches) a patch is forgotten only once restored."""
    interrupt = set()

    class Flaky:
        def __setattr__(self, name, value):
            if name in interrupt and value == "original":
                interrupt.discard(name)
                raise KeyboardInterrupt
            object.__setattr__(self, name, value)

    target = Flaky()
    for name in "abc":
        setattr(target, name, "original")
    patcher = Patcher()
    for name in "abc":
        patcher.install(target, name, lambda original: "patched")
    interrupt.add("b")
    with pytest.raises(KeyboardInterrupt):
        patcher.restore_all()
    assert (target.a, target.b, target.c) == ("original", "patched", "original") and len(patcher) == 1
    assert patcher.restore_all() == 1 and target.b == "original" and len(patcher) == 0
