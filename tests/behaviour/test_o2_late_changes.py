"""What is done to an O2 model after ``initialize`` either works as in fp32 or is refused naming the fix.

* ``model.half()`` / ``.bfloat16()`` / ``.to(torch.bfloat16)`` (of the model or a submodule) is refused before any
  weight changes: the fp32 params are O2's only weights. ``.to(device)`` and ``.float()`` still work.
* A float buffer registered after initialize (``spectral_norm`` applied later) is cast as initialize casts
  buffers: the run is bitwise the run with ``spectral_norm`` applied before initialize.
* An in-place edit of a weight during a call (``nn.Embedding(max_norm=...)``) reaches the fp32 param under
  ``torch.inference_mode`` and under ``torch.compile`` as under ``no_grad``.
* The two-copy layout (``master_weights="remainder"``, ``master_rounding="split"``): a submodule's own
  ``load_state_dict`` reaches the fp32 masters exactly; an optimizer stepping an inner optimizer with groups of
  its own (``ZeroRedundancyOptimizer``'s shape) is refused at initialize.
"""
import pytest
import torch
import torch.nn as nn

import amp_patch

HALF = torch.bfloat16


def _o2(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0, **kw)


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.to(torch.bfloat16),
                                     lambda m: m[0].to(dtype=torch.float16)],
                         ids=["half", "bfloat16", "to", "submodule"])
def test_converting_the_model_to_half_is_refused_before_anything_changes(convert):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    model, opt = _o2(model)
    try:
        with pytest.raises(amp_patch.UsageError, match="after amp_patch.initialize.*O2.*Leave the model fp32"):
            convert(model)
        assert all(p.dtype is torch.float32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))
        model.to("cpu").float()  # conversions that keep fp32 pass
        assert model(torch.randn(3, 4)).dtype is torch.float32
    finally:
        amp_patch.deinitialize()


def _spectral_run(late):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    if not late:
        model[0] = nn.utils.spectral_norm(model[0])
    model, opt = _o2(model)
    try:
        if late:
            model[0] = nn.utils.spectral_norm(model[0])  # (weight_orig is the param the optimizer holds)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            loss = model(x).float().pow(2).mean()
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        amp_patch.deinitialize()


def test_a_buffer_registered_after_initialize_is_cast_as_initialize_casts_buffers():
    early_losses, early = _spectral_run(late=False)
    late_losses, late = _spectral_run(late=True)
    assert late_losses == early_losses
    assert early.keys() == late.keys()
    for k in early:
        assert torch.equal(early[k], late[k]), k


def _embedding_edit(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.mul_(3)
    ids = torch.tensor([[1, 2, 3]])
    model = amp_patch.initialize(model, opt_level="O2", half_dtype=HALF, verbosity=0)
    try:
        if mode == "inference_mode":
            with torch.inference_mode():
                model(ids)
        elif mode == "compile":
            with torch.no_grad():
                torch.compile(model, backend="aot_eager")(ids)
        else:
            with torch.no_grad():
                model(ids)
        return model[0].weight.detach().clone()
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("mode", ["inference_mode", "compile"])
def test_an_in_place_edit_during_a_call_reaches_the_param(mode):
    torch._dynamo.reset()
    expected = _embedding_edit("no_grad")
    torch.manual_seed(0)
    fp32 = nn.Embedding(10, 4, max_norm=0.5)
    with torch.no_grad():
        fp32.weight.mul_(3)
        fp32(torch.tensor([[1, 2, 3]]))
    assert (expected - fp32.weight).abs().max() < 2e-3  # the bf16 renorm, within half tolerance
    assert torch.equal(_embedding_edit(mode), expected)


class Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("layout", [dict(master_weights="remainder"), dict(master_rounding="split")],
                         ids=["remainder", "split"])
def test_two_copy_layout_submodule_load_reaches_the_masters_exactly(layout):
    torch.manual_seed(0)
    model = nn.Sequential(Sub(), nn.Linear(2, 2))
    loaded = {k: torch.randn_like(v) for k, v in model[0].state_dict().items()}
    model, opt = _o2(model, **layout)
    try:
        model[0].load_state_dict(loaded)
        saved = model.state_dict()
        for k, v in loaded.items():
            assert saved["0." + k].dtype is torch.float32
            assert torch.equal(saved["0." + k], v), k
        model(torch.randn(3, 4)).float().sum().backward()  # the next step starts from the loaded values
        opt.zero_grad()
        assert torch.equal(model.state_dict()["0.a.weight"], loaded["a.weight"])
    finally:
        amp_patch.deinitialize()


class Sharded(torch.optim.Optimizer):
    """ZeroRedundancyOptimizer's shape: steps an inner optimizer built over the params with groups of its own."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})
        self.optim = torch.optim.SGD([p for g in self.param_groups for p in g["params"]], lr=0.1)

    def step(self, closure=None):
        return self.optim.step(closure)


@pytest.mark.parametrize("layout", [dict(master_weights="remainder"), dict(master_rounding="split")],
                         ids=["remainder", "split"])
def test_two_copy_layout_refuses_an_optimizer_stepping_its_own_inner_optimizer(layout):
    model = nn.Linear(4, 2)
    opt = Sharded(model.parameters())
    with pytest.raises(amp_patch.UsageError, match="inner optimizer \\('optim', a SGD\\).*master_weights=True"):
        amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0, **layout)
    assert model.weight.dtype is torch.float32
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)  # one owner: fine
    try:
        before = model.weight.detach().clone()
        with amp_patch.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert not torch.equal(model.weight, before)
    finally:
        amp_patch.deinitialize()
