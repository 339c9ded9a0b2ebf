"""A ``scale_loss(...)`` object behaves as the generator-based context manager it replaced: one block per call,
usable as a decorator, closed when dropped while open, refused when exited without being entered or given one
optimizer twice; and what it runs on exit stays out of ``trace()``'s report."""
import gc

import pytest
import torch

import amp_patch
from amp_patch.errors import UsageError


@pytest.fixture
def session():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1", half_dtype=torch.bfloat16,
                                            verbosity=0)
    yield model, optimizer
    amp_patch.deinitialize()


def _loss(model):
    return model(torch.ones(1, 4)).sum()


def test_a_block_dropped_while_open_frees_its_optimizer(session):
    model, optimizer = session

    def enter_and_forget():
        amp_patch.scale_loss(_loss(model), optimizer).__enter__().backward()

    enter_and_forget()
    gc.collect()
    optimizer.zero_grad()
    with amp_patch.scale_loss(_loss(model), optimizer) as scaled:  # (not "already open")
        scaled.backward()
    optimizer.step()
    assert len(amp_patch.history()) == 1


def test_exiting_a_block_never_entered_is_refused(session):
    model, optimizer = session
    with pytest.raises(UsageError, match="without being entered; use it in a with statement"):
        amp_patch.scale_loss(_loss(model), optimizer).__exit__(None, None, None)


def test_one_scale_loss_object_is_one_block(session):
    model, optimizer = session
    block = amp_patch.scale_loss(_loss(model), optimizer)
    with block as scaled:
        scaled.backward(retain_graph=True)
    with pytest.raises(UsageError, match="entered already; each block needs its own call"):
        with block as scaled:
            scaled.backward()
    assert len(amp_patch.history()) == 1


def test_an_optimizer_listed_twice_is_refused(session):
    """Its grads would be unscaled once per listing (65536x too small at fp16's first scale), and the step taken."""
    model, optimizer = session
    with pytest.raises(UsageError, match=r"optimizer listed twice \(\['SGD', 'SGD'\]\); list each optimizer once"):
        with amp_patch.scale_loss(_loss(model), [optimizer, optimizer]) as scaled:
            scaled.backward()
    optimizer.zero_grad()
    with amp_patch.scale_loss(_loss(model), [optimizer]) as scaled:  # (nothing left open)
        scaled.backward()


def test_as_a_decorator_each_call_is_its_own_block(session):
    model, optimizer = session
    loss = _loss(model)

    @amp_patch.scale_loss(loss, optimizer)
    def backward():
        loss.backward(retain_graph=True)

    backward()
    backward()
    assert [row["skipped"] for row in amp_patch.history()] == [False, False]


def test_trace_does_not_report_the_unscale_checks_of_half_grads():
    """O3's half grads take the usual unscale path: the checks it makes of each grad are property reads, not calls
    trace() would list among the unpatched calls on half tensors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O3", loss_scale=128.0, verbosity=0)
    try:
        with amp_patch.autocast(), amp_patch.trace() as tracer:
            loss = model(torch.ones(2, 4).half()).float().sum()
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        listed = {row["qualname"] for row in tracer.unpatched_report()}
    finally:
        amp_patch.deinitialize()
    assert "torch._amp_foreach_non_finite_check_and_unscale_" in listed  # (the report is read: the kernel is there)
    assert not {name for name in listed if name.startswith("torch.Tensor.") and name != "torch.Tensor.to"}
