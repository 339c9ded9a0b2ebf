"""A model passed to initialize together with one of its own submodules (OpenNMT-py's ``amp.initialize([model,
model.generator], optimizer)``) trains as Apex's separate casts trained it, under O1-O3, in either order, under the
apex alias and amp_patch's own API. Two call shapes: the inner model called on the outer's outputs outside its
forward (OpenNMT-py), and called inside the outer's forward (last, or followed by more of the outer's half
layers). The oracle is the program Apex's casts amount to, written out: a half copy of the model run in half,
fp32 masters stepped by the same optimizer from the unscaled half grads (O2), or the half params stepped
directly (O3), bitwise. (Where the inner call is followed by more of the outer's layers Apex raised a dtype
mismatch; amp_patch runs it in half as the outer's other layers run: docs/migration.md.)"""
import copy

import pytest
import torch
from tests_support import Interruptible, forward_on_instance

import amp_patch
from amp_patch.legacy import amp as apex_amp

SCALE = {"O2": 128.0, "O3": 1.0}
SHAPES = ["separate", "inside_last", "inside_mid"]


class Translator(torch.nn.Module):
    """An encoder, a generator submodule (a linear layer and a log-softmax, as OpenNMT-py's), a layer after it."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.encoder = torch.nn.Linear(6, 8)
        self.generator = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.LogSoftmax(dim=-1))
        self.after = torch.nn.Linear(5, 5)

    def forward(self, x):
        hidden = torch.tanh(self.encoder(x))
        if self.shape == "separate":
            return hidden
        out = self.generator(hidden)
        return out if self.shape == "inside_last" else self.after(out)


def _model(shape):
    torch.manual_seed(0)
    model = Translator(shape)
    with torch.no_grad():  # weights a half holds exactly: the masters start from the half values
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def _batches(steps=3):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=gen) for _ in range(steps)]


def _loss(model, generator, x):
    out = model(x)
    if model.shape == "separate":
        out = generator(out)
    return out.float().pow(2).mean()


def _ours(level, shape, alias, inner_first):
    model = _model(shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    models = [model.generator, model] if inner_first else [model, model.generator]
    if alias:
        models, opt = apex_amp.initialize(models, opt, opt_level=level, loss_scale=SCALE[level], verbosity=0)
    else:
        models, opt = amp_patch.initialize(models, opt, opt_level=level, loss_scale=SCALE[level], verbosity=0,
                                           half_dtype=torch.float16)
    outputs = []
    for x in _batches():
        loss = _loss(model, model.generator, x)
        outputs.append(loss.detach())
        opt.zero_grad()
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    weights = [p.detach().float().clone() for p in amp_patch.master_params(opt)]
    dtypes = {k: v.dtype for k, v in {**model.state_dict(), **model.generator.state_dict()}.items()}
    amp_patch.deinitialize()
    return outputs, weights, dtypes, model


def _apex_casts(level, shape):
    """What Apex's casts of each listed model amount to: the half model in half; fp32 masters at O2."""
    half = copy.deepcopy(_model(shape)).half()
    masters = [p.detach().float().clone().requires_grad_() for p in half.parameters()] if level == "O2" else None
    opt = torch.optim.SGD(masters or list(half.parameters()), lr=0.05, momentum=0.9)
    outputs = []
    for x in _batches():
        loss = _loss(half, half.generator, x.half())
        outputs.append(loss.detach())
        opt.zero_grad()
        half.zero_grad()
        (loss * SCALE[level]).backward()
        with torch.no_grad():
            for p, master in zip(half.parameters(), masters or []):
                master.grad = None if p.grad is None else p.grad.float() / SCALE[level]
            if masters is None:
                for p in half.parameters():
                    if p.grad is not None:
                        p.grad.div_(SCALE[level])
            opt.step()
            for p, master in zip(half.parameters(), masters or []):
                p.copy_(master)
    return outputs, [p.detach().float() for p in (masters or half.parameters())]


@pytest.mark.parametrize("alias", [True, False], ids=["apex_alias", "amp_patch"])
@pytest.mark.parametrize("inner_first", [False, True], ids=["outer_first", "inner_first"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_model_with_its_submodule_trains_as_apex_s_separate_casts(level, shape, inner_first, alias):
    outputs, weights, dtypes, model = _ours(level, shape, alias, inner_first)
    ref_outputs, ref_weights = _apex_casts(level, shape)
    assert [o.dtype for o in outputs] == [torch.float32] * 3
    assert all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs))
    assert len(weights) == len(ref_weights) and all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert not all(torch.equal(a, b) for a, b in zip(weights, _model(shape).parameters()))  # (it trained)
    assert set(dtypes.values()) == {torch.float32}  # state_dict() of the outer and of the inner model: fp32
    assert all(p.dtype is torch.float32 for p in model.parameters())  # deinitialize: back to fp32
    assert not model._forward_hooks and not model._forward_pre_hooks and not model.generator._forward_hooks


@pytest.mark.parametrize("alias", [True, False], ids=["apex_alias", "amp_patch"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_inner_model_s_outputs_follow_its_own_casts_only_outside_the_outer_forward(shape, alias):
    model = _model(shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    init = apex_amp.initialize if alias else amp_patch.initialize
    init([model, model.generator], opt, opt_level="O2", verbosity=0, **({} if alias else {"half_dtype": torch.float16}))
    seen = []
    model.generator.register_forward_hook(lambda m, a, out: seen.append(out.dtype))  # after amp_patch's own hook
    assert model(torch.randn(4, 6)).dtype is torch.float32
    assert model.generator(torch.randn(4, 8)).dtype is torch.float32  # called on its own: its output cast
    expected = [torch.float32] if shape == "separate" else [torch.float16, torch.float32]
    assert seen == expected
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 7))  # a forward that raises closes the outer's forward all the same
    assert model.generator(torch.randn(4, 8)).dtype is torch.float32


@pytest.mark.parametrize("forward", ["class", "instance"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_an_outer_forward_cut_off_by_ctrl_c_leaves_the_inner_output_cast_on(shape, level, forward):
    """Ctrl-C (a ``BaseException``) runs no always-called hook of torch's: the guard on the model class's forward
    ends the outer's forward as it unwinds, and where it cannot (``forward`` set on the instance) the forward is
    found gone by its call's frame; it is not counted open for the rest of the session (the generator's outputs
    then stayed half)."""
    model = _model(shape)
    if forward == "instance":
        forward_on_instance(model)
    model.encoder = torch.nn.Sequential(model.encoder, Interruptible())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    extra = {"cast_model_outputs": torch.float32} if level == "O1" else {}
    amp_patch.initialize([model, model.generator], opt, opt_level=level, verbosity=0, half_dtype=torch.bfloat16,
                         **extra)
    seen = []
    model.generator.register_forward_hook(lambda m, a, out: seen.append(out.dtype))  # after amp_patch's own hook
    for _ in range(2):
        model.encoder[1].armed = True
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(4, 6))
        model.encoder[1].armed = False
    assert model.generator(torch.randn(4, 8)).dtype is torch.float32  # called on its own: its output cast
    assert model(torch.randn(4, 6)).dtype is torch.float32
    inside = [] if shape == "separate" else [torch.bfloat16]  # inside the outer's forward: the outer's cast only
    assert seen == [torch.float32] + inside


@pytest.mark.parametrize("alias", [True, False], ids=["apex_alias", "amp_patch"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_model_with_its_submodule_trains_under_o1(shape, alias):
    model = _model(shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    init = apex_amp.initialize if alias else amp_patch.initialize
    init([model, model.generator], opt, opt_level="O1", verbosity=0,
         **({} if alias else {"half_dtype": torch.bfloat16}))
    before = model.encoder.weight.detach().clone()
    for x in _batches(2):
        loss = _loss(model, model.generator, x)
        opt.zero_grad()
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    assert loss.isfinite() and not torch.equal(before, model.encoder.weight)
