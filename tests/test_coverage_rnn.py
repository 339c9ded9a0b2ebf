"""RNNs under O1: nn.LSTM/GRU/RNN and the cells reach torch._VF; they must run in the half dtype."""
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import amp_patch
from tests_support import CountCasts

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
    # per forward: the input and the zero h0/c0 (fp32, made by nn.LSTM) are cast; the weights only the first time
    assert counter.casts == weights + 2 * 3


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
