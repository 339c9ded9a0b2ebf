"""Once training is under way, a step costs amp_patch no walk over the model's modules: what it collected at
initialize (O2's weight slots, the dtype check of the model's params) is collected again only when something is
registered into the model. Real architectures register modules of their own on every call (HF models build
``CrossEntropyLoss()`` inside ``forward``, which registers its ``weight`` buffer); that is no change to the model.
The walks are counted, not timed: a walk of a model is ``Module.named_modules`` called from amp_patch's code."""
import sys

import pytest
import torch
from torch import nn

import amp_patch
from tests import zoo

MODELS = ["gpt2-eager", "bert-eager", "t5-eager", "llama-sdpa", "vit-sdpa", "whisper-eager", "encoder",
          "transformer", "resnet", "lstm-seq2seq"]


@pytest.fixture
def walks(monkeypatch):
    """``walks()``: how many walks of a model amp_patch's code started since the last call."""
    counted = [0]
    original = nn.Module.named_modules

    def named_modules(self, *args, **kwargs):
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename.endswith("torch/nn/modules/module.py"):
            caller = caller.f_back  # (modules() and the recursion itself)
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


def test_a_module_attached_after_initialize_is_still_seen_at_the_next_forward(walks):
    """The other side: registering into the model is a change, and O2 picks the new module's params up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        model(torch.randn(2, 4))
        head = nn.Linear(4, 2)  # (built outside the model: its own registrations are not the model's)
        model.add_module("head", head)
        optimizer.add_param_group({"params": head.parameters()})
        out = model(torch.randn(2, 4))
        assert out.dtype is torch.float32 and head.weight.dtype is torch.float32
        assert walks() > 0
        out.sum().backward()
        assert head.weight.grad is not None and head.weight.grad.dtype is torch.float32
    finally:
        amp_patch.deinitialize()


def test_a_module_attached_inside_a_module_attached_after_initialize_is_seen():
    """The model's modules are taken again after each registration into it: a layer appended to a container
    that itself joined the model after initialize is part of the model too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        model.append(nn.Sequential())
        model(torch.randn(2, 4))
        model[1].append(nn.Linear(4, 2))
        optimizer.add_param_group({"params": model[1].parameters()})
        out = model(torch.randn(2, 4))
        assert out.shape == (2, 2) and out.dtype is torch.float32
    finally:
        amp_patch.deinitialize()
