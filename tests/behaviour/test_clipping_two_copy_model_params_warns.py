"""Under O2's two-copy layouts (``master_weights="remainder"``, ``master_rounding="split"``) the grads live on the
fp32 masters after ``scale_loss``: ``clip_grad_norm_``/``clip_grad_value_`` of ``model.parameters()`` clip nothing.
amp_patch logs one warning naming the fix; clipping the masters, and default O2, log none; the results are the
ones torch's clipping gives (the wrapper passes every argument through)."""
import logging

import pytest
import torch

import amp_patch
from amp_patch.patching import registry

TWO_COPY = [{"master_weights": "remainder"}, {"master_rounding": "split"}]


def _setup(**extra):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0, **extra)
    return model, opt


def _backward(model, opt):
    with amp_patch.scale_loss(model(torch.randn(4, 8)).float().pow(2).sum() * 100, opt) as scaled:
        scaled.backward()


def _warnings(caplog):
    return [r for r in caplog.records if r.name == "amp_patch" and "clip" in r.getMessage()]


@pytest.mark.parametrize("extra", TWO_COPY)
@pytest.mark.parametrize("clip", ["clip_grad_norm_", "clip_grad_value_"])
def test_clipping_the_model_params_under_two_copies_warns_once(caplog, extra, clip):
    model, opt = _setup(**extra)
    caplog.set_level(logging.WARNING, logger="amp_patch")
    for _ in range(2):
        _backward(model, opt)
        try:
            getattr(torch.nn.utils, clip)(model.parameters(), 0.5)  # (a generator, as scripts pass it)
        except RuntimeError as exc:  # torch's clip_grad_value_ fails on all-None grads (after the warning)
            assert clip == "clip_grad_value_" and "empty" in str(exc)
        opt.step()
        opt.zero_grad()
    found = _warnings(caplog)
    assert len(found) == 1, [r.getMessage() for r in found]
    message = found[0].getMessage()
    assert clip in message and "amp_patch.master_params(optimizer)" in message and "default O2" in message


@pytest.mark.parametrize("extra", TWO_COPY)
def test_clipping_the_masters_under_two_copies_clips_silently(caplog, extra):
    model, opt = _setup(**extra)
    caplog.set_level(logging.WARNING, logger="amp_patch")
    _backward(model, opt)
    masters = list(amp_patch.master_params(opt))
    grads = [p.grad.clone() for p in masters]
    norm = torch.nn.utils.clip_grad.clip_grad_norm_(masters, 0.5)
    assert torch.equal(norm, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    assert norm > 0.5 and abs(torch.nn.utils.get_total_norm([p.grad for p in masters]).item() - 0.5) < 1e-3
    assert _warnings(caplog) == []


def test_clipping_the_model_params_under_default_o2_clips_silently(caplog):
    model, opt = _setup()
    caplog.set_level(logging.WARNING, logger="amp_patch")
    _backward(model, opt)
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) > 0.5
    assert _warnings(caplog) == []
    assert not any("clip_grad" in site for site in registry.installed())  # (no patch where nothing can go wrong)


def test_the_clipping_patch_is_undone_by_deinitialize():
    originals = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_)
    _setup(master_weights="remainder")
    assert "torch.nn.utils.clip_grad_norm_" in registry.installed()
    amp_patch.deinitialize()
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_) == originals
