"""Once training is under way, a step costs amp_patch no walk over the model's modules: what it collected at
initialize (O2's weight slots, the dtype check of the model's params) is collected again only when something is
registered into the model. Real architectures register modules of their own on every call (HF models build
``CrossEntropyLoss()`` inside ``forward``, which registers its ``weight`` buffer); that is no change to the model.
The walks are counted, not timed: a walk of a model is ``Module.named_modules`` called from amp_patch's code."""
import sys

import pytest
import torch
import zoo  # (tests/zoo.py: conftest.py puts tests/ on the path)
from torch import nn

import amp_patch

MODELS = ["gpt2-eager", "bert-eager", "t5-eager", "llama-sdpa", "vit-sdpa", "whisper-eager", "encoder",
          "transformer", "resnet", "lstm-seq2seq"]


@pytest.fixture
def walks(monkeypatch):
    """``walks()``: how many walks of a model amp_patch's code started since the last call."""
    counted = [0]
    original = nn.Module.named_modules

    def named_modules(self, *args, **kwargs):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "named_modules":  # (its recursion into the children: the same walk)
            return original(self, *args, **kwargs)
        while caller is not None and caller.f_code.co_filename.endswith("torch/nn/modules/module.py"):
            caller = caller.f_back  # (modules(), named_parameters() and the like)
        if caller is not None and "amp_patch" in caller.f_code.co_filename.replace("\\", "/").split("/")[-3:-1]:
            counted[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", named_modules)

    def take():
        found, counted[0] = counted[0], 0
        return found
    return take


def _steps(case, model, optimizer, batches):
    for batch in batches:
        loss = case.loss_fn(zoo._call(model, batch), batch).float()
        with amp_patch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", MODELS)
def test_a_steady_step_of_a_real_architecture_walks_no_module(name, level, walks):
    case = zoo._build(name)
    optimizer = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(case.model, optimizer, opt_level=level, half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        batches = zoo._batches(case, 3)
        _steps(case, model, optimizer, batches[:1])  # (the first step's one-time checks may walk)
        walks()
        _steps(case, model, optimizer, batches[1:])
        assert walks() == 0
    finally:
        amp_patch.deinitialize()


class _Rotary(nn.Module):
    """A rotary embedding of HF's ``longrope`` / ``dynamic`` kinds: it registers its ``inv_freq`` again in forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.proj = nn.Linear(4, 4)

        self.seen = []  # the buffer's dtype as each call starts

    def forward(self, x):
        self.seen.append(self.inv_freq.dtype)
        self.register_buffer("inv_freq", torch.arange(4.0) / 4, persistent=False)
        return self.proj(x) * self.inv_freq


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_buffer_registered_in_every_forward_walks_no_module_and_is_cast_as_before(level, walks):
    torch.manual_seed(0)
    model = _Rotary()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        for step in range(4):
            if step == 2:
                walks()
            loss = model(torch.randn(2, 4)).float().sum()
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert walks() == 0
    finally:
        amp_patch.deinitialize()
    # O2 gives a buffer registered after initialize the half dtype at the next call (O3 leaves it as registered)
    assert model.seen[1:] == [torch.bfloat16 if level == "O2" else torch.float32] * 3
    assert model.inv_freq.dtype is torch.float32


@pytest.mark.parametrize("built", ["before the call", "after the call"])
def test_a_loss_module_built_on_every_step_costs_at_most_a_membership_walk(built, walks):
    """A script building its loss module per step (its ``weight`` buffer is registered into a module outside the
    model): built after the model's call, it is gone by the next call and costs nothing; built before it
    (``nn.CrossEntropyLoss()(model(x), y)`` builds the module first), it is alive at the call, which walks the
    model once to see that it is not part of it. Neither collects the model's slots or checks its dtypes again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        for step in range(4):
            if step == 1:
                walks()
            if built == "before the call":
                loss = nn.CrossEntropyLoss()(model(torch.randn(2, 4)), torch.tensor([0, 2]))
            else:
                out = model(torch.randn(2, 4))
                loss = nn.CrossEntropyLoss()(out, torch.tensor([0, 2]))
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert walks() <= (3 if built == "before the call" else 0)
    finally:
        amp_patch.deinitialize()
