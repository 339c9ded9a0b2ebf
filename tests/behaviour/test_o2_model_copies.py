"""Copies, pickles and dtype changes of a model during an O2/O3 session.

* ``copy.deepcopy`` (EMA and teacher copies, timm's ModelEmaV2): the copy is independent of the session, a
  plain model in the current dtypes whose ``state_dict()`` is its own; EMA code keeps working and never
  touches the original's fp32 masters.
* ``torch.save(model)`` / ``pickle.dumps(model)`` during a session work (the hooks are picklable objects);
  the loaded model is such a copy.
* ``model.float()`` after initialize (O3): the input cast follows the weights' dtype. A module added after
  initialize in another dtype (a new fp32 head) is refused at the forward, naming the fix.
* O2: the model's params are fp32 (the masters) and the forward runs on half compute copies, so a copy or a
  pickle holds the fp32 weights and runs in fp32 (its hooks are inert), ``model.float()`` changes nothing, and a
  new fp32 head gets compute copies like the rest.
"""
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from tests_support import compute_dtypes

import amp_patch
from amp_patch.errors import UsageError

HALF = torch.bfloat16
CAST_LEVELS = ("O2", "O3")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.lin(x))))


def _data(steps=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in range(steps)]


def _session(level):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return amp_patch.initialize(model, opt, opt_level=level, half_dtype=HALF, verbosity=0)


def _step(model, opt, x, y):
    opt.zero_grad()
    with amp_patch.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()


def _ema_update(ema, model, decay=0.9):
    """timm's ModelEmaV2._update, verbatim in substance: over both state_dicts' values, in place."""
    with torch.no_grad():
        for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(decay * ema_v + (1.0 - decay) * model_v)


def _train(level, with_ema):
    model, opt = _session(level)
    ema = copy.deepcopy(model) if with_ema else None
    expected = {k: v.clone() for k, v in ema.state_dict().items()} if with_ema else {}
    for x, y in _data():
        _step(model, opt, x, y)
        if ema is not None:
            for name, value in model.state_dict().items():  # the same update, on plain tensors
                expected[name].copy_(0.9 * expected[name] + 0.1 * value)
            _ema_update(ema, model)
    for name, value in expected.items():
        assert torch.equal(ema.state_dict()[name], value), name
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    amp_patch.deinitialize()
    return trained, ema


@pytest.mark.parametrize("level", CAST_LEVELS)
def test_deepcopy_is_independent_of_the_session(level):
    model, _ = _session(level)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    twin = copy.deepcopy(model)
    own = dict(twin.named_parameters())
    for name, value in twin.state_dict().items():  # its own tensors, in their current dtypes
        if name in own:
            assert value.data_ptr() == own[name].data_ptr() and value.dtype == own[name].dtype, name
    twin.load_state_dict({k: torch.zeros_like(v) for k, v in twin.state_dict().items()})
    for name, value in model.state_dict().items():  # the original's state (O2: its masters) is untouched
        assert torch.equal(value, original[name]), name
    assert all(p.abs().sum() == 0 for p in twin.parameters())
    x = torch.randn(3, 4)
    assert twin.eval()(x).dtype is torch.float32  # the copy's input/output casts follow its own weights


@pytest.mark.parametrize("level", CAST_LEVELS)
def test_an_ema_copy_does_not_change_training(level):
    """The EMA copy's updates never reach the model being trained (they wrote its masters: ModelEmaV2 pattern)."""
    plain, _ = _train(level, with_ema=False)
    trained, ema = _train(level, with_ema=True)
    for name in plain:
        assert torch.equal(plain[name], trained[name]), name
    assert ema.eval()(torch.randn(3, 4)).dtype is torch.float32  # still usable after the session


@pytest.mark.parametrize("level", ("O1",) + CAST_LEVELS)
@pytest.mark.parametrize("how", ("torch.save", "pickle"))
def test_model_can_be_saved_whole_during_a_session(level, how):
    model, opt = _session(level)
    x, y = _data(1)[0]
    _step(model, opt, x, y)
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    model.eval(), loaded.eval()
    if level == "O2":  # the fp32 weights, in a plain model: runs as fp32 (as after deinitialize)
        reference = Net().eval()
        reference.load_state_dict(model.state_dict())
        assert torch.equal(loaded(x), reference(x))
    else:
        assert torch.equal(loaded(x), model(x))  # same weights, same casts
    for (name, p), q in zip(loaded.named_parameters(), model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
        assert loaded.state_dict()[name].data_ptr() == p.data_ptr()  # its own state_dict


def test_model_float_under_o2_changes_nothing():
    model, opt = _session("O2")
    x, y = _data(1)[0]
    _step(model, opt, x, y)
    model.eval()
    before = model(x)
    model.float()  # the params already are fp32
    assert torch.equal(model(x), before) and compute_dtypes(model, x)["lin.weight"] is HALF


def test_model_float_after_initialize_runs_in_fp32_and_trains():
    level = "O3"
    model, opt = _session(level)
    x, y = _data(1)[0]
    _step(model, opt, x, y)
    model.float()
    reference = copy.deepcopy(model)  # (a plain fp32 module with the same weights once the hooks are inert)
    for hooks in (reference._forward_pre_hooks, reference._forward_hooks):
        hooks.clear()
    model.eval(), reference.eval()
    assert torch.equal(model(x), reference(x))
    model.train()
    _step(model, opt, x, y)  # masters still train the (now fp32) model
    assert all(p.dtype is torch.float32 for p in model.parameters())


def test_a_new_fp32_head_under_o2_gets_compute_copies():
    model, opt = _session("O2")
    model.head = torch.nn.Linear(6, 3)
    x = torch.randn(5, 4)
    assert compute_dtypes(model, x)["head.weight"] is HALF and model(x).shape == (5, 3)
    assert model.head.weight.dtype is torch.float32


def test_a_new_fp32_head_is_refused_naming_the_fix():
    model, opt = _session("O3")
    model.head = torch.nn.Linear(6, 3)
    x = torch.randn(5, 4)
    with pytest.raises(UsageError, match=r"'head.weight'.*torch.float32.*bfloat16.*model.head.to\(torch.bfloat16\)"):
        model(x)
    model.head.to(HALF)
    assert model(x).shape == (5, 3)


@pytest.mark.parametrize("level", ("O1", "O2"))
def test_copies_with_diagnose_overflow_leave_the_session_alone(level):
    """The overflow diagnoser's hooks belong to the session: a copy neither pickles them nor feeds them."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=HALF, verbosity=0,
                                      diagnose_overflow=True)
    diagnoser = amp_patch.session.state.current().observe.diagnoser
    loaded = pickle.loads(pickle.dumps(model))
    twin = copy.deepcopy(model)
    flags = len(diagnoser.flags)
    x = torch.randn(5, 4)
    loaded(x), twin(x)
    assert len(diagnoser.flags) == flags
    model(x)
    assert len(diagnoser.flags) > flags  # (the original still reports)
