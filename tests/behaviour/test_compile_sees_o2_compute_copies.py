"""O2 under torch.compile: every compiled call of an O2 model runs with its half compute copies, however the
process compiled the model's class before (dynamo shares a graph between instances of a class and, by default,
does not guard on module hooks, which is where O2's copies are made)."""
import pytest
import torch

import amp_patch
from amp_patch.model import compile_guards
from amp_patch.patching import registry

X = torch.randn(16, 8)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _o2(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)[0]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_model_compiled_before_initialize_runs_its_compute_copies_after():
    model = _net()
    compiled = torch.compile(model, backend="eager")
    fp32 = compiled(X)
    _o2(model)
    assert torch.equal(compiled(X), model(X))  # eager O2 (half compute), not the fp32 graph
    assert not torch.equal(compiled(X), fp32)


def test_an_fp32_instance_of_the_class_compiled_during_the_session_does_not_serve_the_o2_model():
    model = _o2(_net())
    compiled = torch.compile(model, backend="eager")
    compiled(X)
    baseline = _net()
    compiled_baseline = torch.compile(baseline, backend="eager")
    assert torch.equal(compiled_baseline(X), baseline(X))  # the fp32 instance's own graph: fp32
    assert torch.equal(compiled(X), model(X))  # and the O2 model still its own: half compute
    assert torch.equal(compiled_baseline(X), baseline(X))


def test_after_deinitialize_the_compiled_model_is_fp32_again_and_dynamos_flag_is_back():
    flag = torch._dynamo.config.skip_nnmodule_hook_guards
    model = _o2(_net())
    compiled = torch.compile(model, backend="eager")
    compiled(X)
    assert compile_guards.SITE in registry.installed()
    amp_patch.deinitialize()
    assert torch._dynamo.config.skip_nnmodule_hook_guards == flag
    assert compile_guards.SITE not in registry.installed()
    assert torch.equal(compiled(X), model(X))


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        before = next(self.parameters()).dtype
        y = self.lin(x)
        return y, (before, self.lin.weight.dtype, next(self.parameters()).dtype)


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        return self.inner(x)


def test_a_weight_read_after_its_modules_call_in_a_compiled_forward_is_the_copy():
    """The traced call's depth counts every hooked module's call: an inner one's end does not put the fp32 params
    back (it did while that state was a thread-local, whose changes dynamo does not track). HF BERT and T5 (eager
    attention) read ``self.dtype`` (the first param's) after their embeddings ran and build the attention mask in
    it: it was fp32 under compile, and the next matmul raised."""
    model = _o2(_Outer())
    assert model(X[:, :8])[1] == (torch.bfloat16,) * 3
    assert torch.compile(model, backend="eager")(X[:, :8])[1] == (torch.bfloat16,) * 3


class _BreakThenCheckpoint(torch.nn.Module):
    """A checkpointed segment reading a weight whose module it does not call, run in the eager part of a compiled
    call (HF T5's shape under torch.compile: its layers' checkpoint runs past a graph break)."""

    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.a, self.b, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def segment(self, h):
        return torch.relu(torch.nn.functional.linear(h, self.b.weight, self.b.bias))

    def forward(self, x):
        return self.head(self.checkpointed(self.a(x)))

    @torch._dynamo.disable  # (run by dynamo as a graph break: eagerly, inside the compiled call)
    def checkpointed(self, h):
        return torch.utils.checkpoint.checkpoint(self.segment, h, use_reentrant=self.use_reentrant)


def _train(compiled, use_reentrant, steps=2):
    torch.manual_seed(0)
    model = _BreakThenCheckpoint(use_reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    run = torch.compile(model, backend="eager") if compiled else model
    try:
        for _ in range(steps):
            opt.zero_grad()
            loss = run(X.requires_grad_(use_reentrant)).float().pow(2).mean()
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_a_checkpoint_in_the_eager_part_of_a_compiled_call_recomputes_on_its_copies(use_reentrant):
    """The recompute re-enters the compiled call's copies (it saw no call: the traced call's state was not read)."""
    eager, compiled = _train(False, use_reentrant), _train(True, use_reentrant)
    assert all(torch.equal(p, q) for p, q in zip(compiled, eager))
