"""The per-iteration cast cache, proven by counting aten._to_copy with a TorchDispatchMode."""
import threading

import pytest
import torch
import torch.nn.functional as F
from tests_support import CountCasts

import amp_patch


class Reuse(torch.nn.Module):
    """One weight used three times per forward."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        for _ in range(3):
            x = F.linear(x, self.w, self.b)
        return x


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def model(request):
    torch.manual_seed(0)
    m = Reuse()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    m, opt = amp_patch.initialize(m, opt, opt_level="O1", half_dtype=request.param, verbosity=0)
    yield m, opt, request.param
    amp_patch.deinitialize()


def test_each_weight_cast_once_per_iteration(model):
    m, opt, half = model
    x = torch.randn(2, 4)
    for _ in range(2):  # two iterations: the cache is cleared by scale_loss in between
        with CountCasts() as counter:
            out = m(x)
        # input x once, weight once, bias once; the activations are already half
        assert counter.casts == 3, counter.dtypes
        assert out.dtype is half
        with amp_patch.scale_loss(out.float().sum(), opt) as scaled:
            scaled.backward()
        assert m.w.grad.dtype is torch.float32 and m.b.grad.dtype is torch.float32


def test_clear_cache_forces_a_new_cast(model):
    m, _, _ = model
    x = torch.randn(2, 4)
    m(x)
    amp_patch.clear_cache()
    with CountCasts() as counter:
        m(x)
    assert counter.casts == 3


def test_no_grad_entry_never_serves_a_grad_call(model):
    m, _, _ = model
    x = torch.randn(2, 4)
    with torch.no_grad():
        m(x)  # caches casts made without autograd history
    out = m(x)
    out.float().sum().backward()
    assert m.w.grad is not None and m.b.grad is not None, "a stale no_grad cast cut the weight out of the graph"


def _three_linears(m, x):
    """m's forward without the module call (each forward of a session's model starts with an empty cache)."""
    for _ in range(3):
        x = F.linear(x, m.w, m.b)
    return x


def test_grad_entry_may_serve_a_no_grad_call(model):
    m, _, _ = model
    x = torch.randn(2, 4)
    with amp_patch.autocast():  # (outside a forward or a region nothing is cached: see test_cast_cache_regions)
        _three_linears(m, x)
        with CountCasts() as counter, torch.no_grad():
            _three_linears(m, x)
    assert counter.casts == 1  # only the input


def test_each_forward_of_the_model_starts_with_an_empty_cache(model):
    m, _, _ = model
    x = torch.randn(2, 4)
    m(x)
    with CountCasts() as counter, torch.no_grad():
        m(x)
    assert counter.casts == 3  # a weight may have changed through .data since (undetectable): cast again


def test_inplace_weight_update_invalidates(model):
    m, _, half = model
    x = torch.randn(2, 4)
    with amp_patch.autocast():
        _three_linears(m, x)
        with torch.no_grad():
            m.w.add_(1.0)
        with CountCasts() as counter:
            out = _three_linears(m, x)
    assert counter.casts == 2  # x and the changed weight; the bias entry is still valid
    expected = x.to(half)
    for _ in range(3):
        expected = F.linear(expected, m.w.detach().to(half), m.b.detach().to(half))
    assert torch.equal(out.detach(), expected)


def test_threads_share_the_cache_safely(model):
    m, _, half = model
    inputs = [torch.randn(2, 4) for _ in range(8)]
    results, errors = {}, []
    barrier = threading.Barrier(4)

    def work(k):
        try:
            barrier.wait(10)
            for i in range(k, len(inputs), 4):
                for _ in range(20):
                    out = m(inputs[i])
                    out.float().sum().backward()
                    if i % 3 == 0:
                        amp_patch.clear_cache()
                results[i] = out.detach()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i, x in enumerate(inputs):
        ref = x.to(half)
        for _ in range(3):
            ref = F.linear(ref, m.w.detach().to(half), m.b.detach().to(half))
        assert results[i].dtype is half and torch.equal(results[i], ref)
