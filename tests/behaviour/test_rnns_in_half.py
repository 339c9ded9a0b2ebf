"""RNNs under O1: nn.LSTM/GRU/RNN and the cells reach torch._VF; they must run in the half dtype."""
import pytest
import torch
from tests_support import CountCasts
from torch.nn.utils.rnn import pack_padded_sequence

import amp_patch

HALVES = [torch.float16, torch.bfloat16]


def _outputs(out):
    if isinstance(out, tuple):
        return [t for o in out for t in (_outputs(o) if isinstance(o, (tuple, list)) else [o])]
    return [out.data if hasattr(out, "batch_sizes") else out]


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, True)])
def test_rnn_modules_run_in_half(half, cls, layers, bidirectional):
    torch.manual_seed(0)
    rnn = cls(3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=True)
    opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
    rnn, opt = amp_patch.initialize(rnn, opt, opt_level="O1", half_dtype=half, verbosity=0)
    x = torch.randn(2, 5, 3, requires_grad=True)
    out = rnn(x)
    assert all(t.dtype is half for t in _outputs(out))
    with amp_patch.scale_loss(out[0].float().sum(), opt) as scaled:
        scaled.backward()
    assert x.grad.dtype is torch.float32
    assert all(p.grad is not None and p.grad.dtype is torch.float32 for p in rnn.parameters())


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_packed_sequence_and_weights_cast_once(half):
    rnn = amp_patch.initialize(torch.nn.LSTM(3, 4, num_layers=2), opt_level="O1", half_dtype=half, verbosity=0)
    x = torch.randn(5, 2, 3)
    packed = pack_padded_sequence(x, torch.tensor([5, 3]))
    with CountCasts() as counter:
        out, (h, c) = rnn(packed)
        rnn(packed)
    assert out.data.dtype is half and h.dtype is half and c.dtype is half
    weights = len(list(rnn.parameters()))
    # per forward: the input, the zero h0/c0 (fp32, made by nn.LSTM) and each weight once (every forward of a
    # session's model starts with an empty cast cache, as a torch.autocast region does)
    assert counter.casts == 2 * (weights + 3)


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell])
def test_cells_run_in_half(half, cls):
    cell = amp_patch.initialize(cls(3, 4), opt_level="O1", half_dtype=half, verbosity=0)
    x = torch.randn(2, 3, requires_grad=True)
    out = cell(x)
    assert all(t.dtype is half for t in (out if isinstance(out, tuple) else (out,)))
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    assert x.grad.dtype is torch.float32 and cell.weight_ih.grad.dtype is torch.float32


def test_rnn_entries_can_be_moved_to_float():
    spec = ["apex", {"remove": {"torch._VF": ["lstm"]}, "add": {"float": {"torch._VF": ["lstm"]}}}]
    rnn = amp_patch.initialize(torch.nn.LSTM(3, 4), opt_level="O1", op_lists=spec, verbosity=0)
    gru = torch.nn.GRU(3, 4)
    x = torch.randn(5, 2, 3)
    assert rnn(x)[0].dtype is torch.float32 and gru(x)[0].dtype is torch.float16


# -- half activations into RNNs (a half Linear/conv front end feeding an fp32 nn.LSTM) ------------------------
class FrontEnd(torch.nn.Module):
    """Linear (half under O1) -> RNN module or cell, the half activation kept for its grad."""

    def __init__(self, rnn, features=3):
        super().__init__()
        self.proj = torch.nn.Linear(features, features)
        self.rnn = rnn

    def forward(self, x, hx=None, lengths=None):
        self.act = self.proj(x)
        self.act.retain_grad()
        inp = self.act if lengths is None else pack_padded_sequence(self.act, lengths, batch_first=True)
        return self.rnn(inp) if hx is None else self.rnn(inp, hx)


def _hidden(cls, shape, dtype, proj=0):
    h = torch.randn(*shape[:-1], proj or shape[-1], dtype=dtype)
    return (h, torch.randn(*shape, dtype=dtype)) if cls in (torch.nn.LSTM, torch.nn.LSTMCell) else h


RNN_LAYOUTS = {  # name: (constructor kwargs, packed?, hidden state shape (layers*dirs, batch, hidden) or None)
    "plain": ({}, False, None),
    "2 layers bidirectional batch_first": (dict(num_layers=2, bidirectional=True, batch_first=True), False, None),
    "packed batch_first": (dict(batch_first=True), True, None),
    "fp32 hidden": (dict(num_layers=2), False, (2, 2, 4)),
    "half hidden, bidirectional": (dict(bidirectional=True, batch_first=True), False, (2, 2, 4)),
}


def _flat(out):
    if hasattr(out, "batch_sizes"):
        return [out.data]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


def _run_front_end(model, opt, x, hx, lengths):
    flat = _flat(model(x, hx, lengths))
    sum(t.float().mean() for t in flat).backward()  # unscaled: x.grad (not a param) is read as is
    return flat


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_half_activations_into_rnn_modules_every_layout(half, cls):
    """O1: the RNN's input comes from a half op; every layout runs, outputs are half, the grad of the half
    activation is half and of the fp32 model input fp32 (torch's own check would raise: dtype mismatch)."""
    layouts = dict(RNN_LAYOUTS)
    if cls is torch.nn.LSTM:
        layouts["proj_size, fp32 hidden"] = (dict(proj_size=2, num_layers=2), False, (2, 2, 4))
    for name, (kwargs, packed, hshape) in layouts.items():
        torch.manual_seed(0)
        model = FrontEnd(cls(3, 4, **kwargs))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0)
        try:
            batch_first = kwargs.get("batch_first", False)
            x = torch.randn(*((2, 5) if batch_first or packed else (5, 2)), 3, requires_grad=True)
            hdtype = half if name.startswith("half") else torch.float32
            hx = _hidden(cls, hshape, hdtype, kwargs.get("proj_size", 0)) if hshape else None
            flat = _run_front_end(model, opt, x, hx, torch.tensor([5, 3]) if packed else None)
            assert all(t.dtype is half for t in flat), name
            assert model.act.dtype is half and model.act.grad.dtype is half, name
            assert x.grad.dtype is torch.float32 and torch.isfinite(x.grad).all(), name
            assert all(p.grad.dtype is torch.float32 for p in model.parameters()), name
        finally:
            amp_patch.deinitialize()


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_half_activations_into_cells_with_fp32_or_half_state(half):
    for cls in (torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell):
        for hdtype in (None, torch.float32, half):
            model = FrontEnd(cls(3, 4))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0)
            try:
                x = torch.randn(2, 3, requires_grad=True)
                hx = _hidden(cls, (2, 4), hdtype) if hdtype else None
                flat = _run_front_end(model, opt, x, hx, None)
                assert all(t.dtype is half for t in flat), (cls, hdtype)
                assert model.act.grad.dtype is half and x.grad.dtype is torch.float32, (cls, hdtype)
            finally:
                amp_patch.deinitialize()


def test_rnn_dtype_check_is_restored_and_still_guards_outside_o1():
    """The relaxed check lives only while the O1 wrappers that make the dtypes agree are installed."""
    original = vars(torch.nn.modules.rnn.RNNBase)["check_input"]
    lstm = torch.nn.LSTM(3, 4)
    amp_patch.initialize(lstm, opt_level="O1", verbosity=0)
    assert vars(torch.nn.modules.rnn.RNNBase)["check_input"] is not original
    assert lstm(torch.randn(5, 2, 3).half())[0].dtype is torch.float16
    amp_patch.deinitialize()
    assert vars(torch.nn.modules.rnn.RNNBase)["check_input"] is original
    with pytest.raises(ValueError, match="does not match weight dtype"):
        lstm(torch.randn(5, 2, 3).half())
    amp_patch.initialize(lstm, opt_level="O1", verbosity=0,
                         op_lists=["apex", {"remove": {"torch._VF": ["lstm"]}}])
    with pytest.raises(ValueError, match="does not match weight dtype"):  # nothing casts for _VF.lstm
        lstm(torch.randn(5, 2, 3).half())


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_rnn_front_end_under_cast_model_levels(level):
    model = FrontEnd(torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, verbosity=0)
    x = torch.randn(5, 2, 3)
    flat = _run_front_end(model, opt, x, _hidden(torch.nn.LSTM, (4, 2, 4), torch.float32), None)
    assert all(torch.isfinite(t).all() for t in flat) and model.act.grad.dtype is torch.float16
