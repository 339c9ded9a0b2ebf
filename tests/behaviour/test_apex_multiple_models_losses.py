"""Apex's multiple models / losses / optimizers semantics, in the shape of Apex's L0 test
``test_multiple_models_optimizers_losses``: fp32 models holding one half weight each, ``cast_model_type=False``,
loss scales 4 and 16, three ways of zeroing grads (``p.grad = None`` on the model's params, ``model.zero_grad()``,
``optimizer.zero_grad()``), an inf injected into one backward's grads; every iteration's master grads and the
final weights are compared with a plain fp32-autograd reference that skips what Apex skipped: the optimizers the
overflowing ``scale_loss`` named, in that iteration only.
"""
import pytest
import torch

import amp_patch
from amp_patch.legacy import amp
from amp_patch.legacy.amp_state import AMP_STATE as _amp_state


class MyModel(torch.nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = torch.nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = torch.nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float16))

    def forward(self, x):
        return (x * self.weight0.float() * self.weight1.float()).sum()


X = torch.ones(2)


def _setup(layout):
    """``2m1o``: two models, two losses, one optimizer; ``3m2o``: three models, loss 1 spans both optimizers."""
    if layout == "2m1o":
        models = [MyModel(1), MyModel(2)]
        opts = [torch.optim.SGD([{"params": models[0].parameters(), "lr": 0.25},
                                 {"params": models[1].parameters(), "lr": 0.5}], momentum=0.125)]
        losses = [lambda m: m[0](X), lambda m: m[1](X)]
        named = [[0], [0]]  # optimizers (indices) each loss's scale_loss names
    else:
        models = [MyModel(1), MyModel(2), MyModel(3)]
        opts = [torch.optim.SGD([{"params": models[0].parameters(), "lr": 0.25},
                                 {"params": models[1].parameters(), "lr": 1.0}], momentum=0.5),
                torch.optim.SGD([{"params": models[2].parameters(), "lr": 0.5}], momentum=0.25)]
        losses = [lambda m: m[0](X) + m[1](X), lambda m: m[2](X) + m[1](X)]
        named = [[0], [0, 1]]
    return models, opts, losses, named


def _reference(layout, iters, inject):
    """fp32 autograd; at iteration ``inject[0]`` the optimizers named by loss ``inject[1]`` do not step."""
    models, opts, losses, named = _setup(layout)
    grads = []
    for i in range(iters):
        for opt in opts:
            opt.zero_grad()
        for loss in losses:
            loss(models).backward()
        skipped = set(named[inject[1]]) if inject and i == inject[0] else set()
        if not skipped:
            grads.append([p.grad.float().clone() for opt in opts for g in opt.param_groups for p in g["params"]])
        for k, opt in enumerate(opts):
            if k not in skipped:
                opt.step()
    return grads, [p.detach().float().clone() for m in models for p in m.parameters()]


def _zero(how, models, opts):
    if how == "none":
        for model in models:
            for p in model.parameters():
                p.grad = None
    elif how == "model":
        for model in models:
            model.zero_grad()
    else:
        for opt in opts:
            opt.zero_grad()


def _amp_run(layout, opt_level, how, loss_ids, iters, inject):
    models, opts, losses, named = _setup(layout)
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        models, opts = amp.initialize(models, opts, opt_level=opt_level, cast_model_type=False, verbosity=0,
                                      num_losses=max(loss_ids) + 1)
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False
    for loss_id, scale in zip(sorted(set(loss_ids)), (4.0, 16.0)):
        _amp_state.loss_scalers[loss_id]._loss_scale = scale
    grads = []
    for i in range(iters):
        _zero(how, models, opts)
        for b, (loss, loss_id) in enumerate(zip(losses, loss_ids)):
            with amp.scale_loss(loss(models), [opts[k] for k in named[b]], loss_id=loss_id) as scaled:
                scaled.backward()
                if inject and (i, b) == inject[:2]:
                    target = models[b] if layout == "2m1o" else models[0 if b == 0 else 2]
                    getattr(target, "weight0" if inject[2] == "fp32" else "weight1").grad[0] = float("inf")
        if not (inject and i == inject[0]):
            grads.append([p.grad.float().clone() for opt in opts for p in amp.master_params(opt)])
        for opt in opts:
            opt.step()
    final = [p.detach().float().clone() for m in models for p in m.parameters()]
    masters = [p.detach().float().clone() for opt in opts for p in amp.master_params(opt)]
    amp.deinitialize()
    return grads, final, masters


CASES = [(layout, level, how) for layout in ("2m1o", "3m2o") for level in ("O0", "O1", "O2", "O3")
         for how in ("none", "model", "optimizer")]


@pytest.mark.parametrize("layout,opt_level,how", CASES)
def test_multiple_models_losses_optimizers_match_fp32_reference(layout, opt_level, how):
    """Item 2: with ``p.grad = None`` zeroing, the O2 master grads do not carry the previous iteration's."""
    for loss_ids in ([0, 1], [0, 0]):
        ref_grads, ref_final = _reference(layout, 2, None)
        grads, final, masters = _amp_run(layout, opt_level, how, loss_ids, 2, None)
        for got, want in zip(grads, ref_grads, strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)
        for got, want in zip(final, ref_final, strict=True):
            torch.testing.assert_close(got, want)
        for model_p, master in zip(final, masters):
            torch.testing.assert_close(model_p, master, atol=1e-3, rtol=1e-3)


INF_CASES = [(layout, level, it, b, loc) for layout in ("2m1o", "3m2o") for level in ("O1", "O2")
             for it in (0, 1) for b in (0, 1) for loc in ("fp16", "fp32")]


@pytest.mark.parametrize("layout,opt_level,which_iter,which_backward,loc", INF_CASES)
def test_an_inf_skips_only_the_optimizers_its_scale_loss_named(layout, opt_level, which_iter, which_backward, loc):
    """Item 3: an inf in loss 0's backward skips optimizer 0 only; loss 1 (which also names optimizer 0 in
    ``3m2o``) checks only the grads its own backward produced, so optimizer 1 steps and loss 1's scaler keeps
    its scale."""
    inject = (which_iter, which_backward, loc)
    ref_grads, ref_final = _reference(layout, 3, inject)
    for loss_ids in ([0, 1], [0, 0]):
        grads, final, _ = _amp_run(layout, opt_level, "none", loss_ids, 3, inject)
        assert len(grads) == len(ref_grads)
        for got, want in zip(grads, ref_grads):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)
        for got, want in zip(final, ref_final, strict=True):
            torch.testing.assert_close(got, want)


def test_a_second_loss_after_an_overflow_leaves_its_own_scaler_alone():
    models, opts, losses, named = _setup("3m2o")
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        models, opts = amp.initialize(models, opts, opt_level="O1", verbosity=0, num_losses=2, loss_scale="dynamic")
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False
    _amp_state.loss_scalers[0]._loss_scale, _amp_state.loss_scalers[1]._loss_scale = 4.0, 16.0
    with amp.scale_loss(losses[0](models), opts[0], loss_id=0) as scaled:
        scaled.backward()
        models[0].weight0.grad[0] = float("inf")
    with amp.scale_loss(losses[1](models), opts, loss_id=1) as scaled:
        scaled.backward()
    scales = [s["loss_scale"] for s in amp.state_dict().values()]
    for opt in opts:
        opt.step()
    skipped = [amp_patch.last_step_skipped(opt) for opt in opts]
    amp.deinitialize()
    assert scales == [2.0, 16.0] and skipped == [True, False]

