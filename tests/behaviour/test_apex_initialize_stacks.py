"""``apex.amp.initialize`` called more than once adds to what is active, as in Apex.

GAN and super-resolution scripts initialize G and D in two calls; Apex's checkpoint test initializes a second
model while the first keeps training; Apex's L0 suite mixes ``amp.init()`` and ``amp.initialize()`` in one
process.
"""
import logging

import pytest
import torch

import amp_patch
from amp_patch.legacy import amp


def _gan(seed=0):
    torch.manual_seed(seed)
    G = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    D = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return G, D, torch.optim.SGD(G.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(D.parameters(), lr=0.1,
                                                                                         momentum=0.9)


def _train_gan(G, D, optG, optD, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        z, real = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
        for p in D.parameters():
            p.grad = None
        loss_d = D(real).float().mean() - D(G(z).detach()).float().mean()
        with amp.scale_loss(loss_d, optD) as scaled:
            scaled.backward()
        optD.step()
        for p in G.parameters():
            p.grad = None
        with amp.scale_loss(-D(G(z)).float().mean(), optG) as scaled:
            scaled.backward()
        optG.step()
    return [p.detach().clone() for opt in (optG, optD) for p in amp.master_params(opt)]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gan_with_two_initialize_calls_equals_one_call_bitwise(opt_level):
    G, D, optG, optD = _gan()
    [G, D], [optG, optD] = amp.initialize([G, D], [optG, optD], opt_level=opt_level, loss_scale=128.0, verbosity=0)
    one = _train_gan(G, D, optG, optD)
    amp.deinitialize()

    G, D, optG, optD = _gan()
    G2, optG2 = amp.initialize(G, optG, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    D2, optD2 = amp.initialize(D, optD, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    assert (G2, optG2, D2, optD2) == (G, optG, D, optD)  # returned as passed, the same objects
    if opt_level == "O2":
        assert {p.dtype for p in G.parameters()} == {torch.float16}  # the first call's model is still cast
    two = _train_gan(G, D, optG, optD)
    amp.deinitialize()
    assert len(one) == len(two) == 8
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_second_model_initialized_while_the_first_keeps_training():
    """Apex's checkpoint test: ``restore_model`` is initialized mid-run; the first model's trajectory (O2
    masters, momentum) is exactly what it would have been, and the loss scalers are the new call's fresh ones."""
    def run(second_call_at):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=64.0, num_losses=2, verbosity=0)
        x = torch.ones(4, 3)
        for step in range(4):
            if step == second_call_at:
                other = torch.nn.Linear(3, 2)
                other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
                amp.initialize(other, other_opt, opt_level="O2", loss_scale=64.0, num_losses=2, verbosity=0)
                assert amp.state_dict()["loss_scaler1"]["loss_scale"] == 64.0
            with amp.scale_loss(model(x).float().pow(2).mean(), opt, loss_id=step % 2) as scaled:
                scaled.backward()
            opt.step()
        masters = [p.detach().clone() for p in amp.master_params(opt)]
        half = [p.detach().clone() for p in model.parameters()]
        amp.deinitialize()
        return masters + half
    assert all(torch.equal(a, b) for a, b in zip(run(None), run(2), strict=True))


def test_a_model_and_optimizer_passed_again_are_not_doubled():
    """The Hugging Face Trainer initializes on every train(): the same model again, and a new optimizer over it,
    which replaces the earlier one (that one gets its model params back)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    old = torch.optim.SGD(model.parameters(), lr=0.1)
    model, old = amp.initialize(model, old, opt_level="O2", loss_scale=8.0, verbosity=0)
    with amp.scale_loss(model(torch.ones(2, 3)).float().sum(), old) as scaled:
        scaled.backward()
    old.step()
    trained = [p.detach().clone() for p in amp.master_params(old)]
    new = torch.optim.SGD(model.parameters(), lr=0.1)
    model, new = amp.initialize(model, new, opt_level="O2", loss_scale=8.0, verbosity=0)
    session = amp_patch.session.state.current()
    assert session.models == [model] and [s.optimizer for s in session.scaling.opt_states.values()] == [new]
    assert all(p.dtype is torch.float16 for g in old.param_groups for p in g["params"])  # old one: model params
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(new), trained))  # continues from the masters
    amp.deinitialize()


def test_a_different_opt_level_closes_the_open_session_with_a_clear_warning(caplog):
    G, D, optG, optD = _gan()
    G, optG = amp.initialize(G, optG, opt_level="O2", verbosity=0)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        D, optD = amp.initialize(D, optD, opt_level="O1", verbosity=0)
    assert "amp.initialize(opt_level='O1') while a session with opt_level 'O2' is open" in caplog.text
    assert "cannot mix different amp options" in caplog.text
    assert all(p.dtype is torch.float32 for p in G.parameters())  # back to fp32, no longer managed
    with pytest.raises(amp_patch.UsageError, match="was not passed to amp_patch.initialize"):
        with amp.scale_loss(G(torch.ones(1, 4)).sum(), optG):
            pass
    with amp.scale_loss(D(torch.ones(1, 4)).float().sum(), optD) as scaled:  # the new session works
        scaled.backward()
    optD.step()
    amp.deinitialize()


def test_refused_while_scaled_grads_wait_for_step():
    G, D, optG, optD = _gan()
    G, optG = amp.initialize(G, optG, opt_level="O1", verbosity=0)
    with amp.scale_loss(G(torch.ones(1, 4)).float().sum(), optG, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(amp_patch.UsageError, match="waiting for step"):
        amp.initialize(D, optD, opt_level="O1", verbosity=0)
    optG.step()
    amp.initialize(D, optD, opt_level="O1", verbosity=0)
    assert len(amp_patch.session.state.current().scaling.opt_states) == 2
    amp.deinitialize()


def test_amp_init_after_o1_initialize_and_the_reverse_both_stay_active():
    """As Apex's L0 suite does in one process: the handle's optimizer wrapper and initialize's optimizer both
    keep scaling (the grads come back unscaled: scaled by 128 on the way in)."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=128.0, verbosity=0)
    handle = amp.init(loss_scale=128.0)
    assert handle.is_active()
    with amp.scale_loss(model(torch.ones(2, 3)).float().sum(), opt) as scaled:
        assert model(torch.ones(2, 3)).dtype is torch.float16  # O1 casting is on
        scaled.backward()
    assert torch.equal(model.weight.grad, torch.full((1, 3), 2.0))
    handle._deactivate()
    assert amp_patch.session.state.current() is None

    handle = amp.init(loss_scale=128.0)
    other = torch.nn.Linear(3, 1)
    other_opt = handle.wrap_optimizer(torch.optim.SGD(other.parameters(), lr=0.0))
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=128.0, verbosity=0)
    assert handle.is_active()  # the rebuilt session keeps the handle
    for optimizer, net, scale in ((other_opt, other, other_opt.scale_loss), (opt, model, None)):
        loss = net(torch.ones(2, 3)).float().sum()
        with (scale(loss) if scale else amp.scale_loss(loss, optimizer)) as scaled:
            assert scaled.item() == pytest.approx(128.0 * loss.item(), rel=1e-2)
            scaled.backward()
        assert torch.equal(net.weight.grad, torch.full((1, 3), 2.0))
        optimizer.step()
    handle._deactivate()
    assert amp_patch.session.state.current() is None


def test_amp_init_after_an_o2_initialize_closes_it_as_the_l0_suite_expects(caplog):
    model = torch.nn.Linear(3, 1)
    model = amp.initialize(model, opt_level="O2", verbosity=0)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        handle = amp.init()
    assert "while a session with opt_level 'O2' is open" in caplog.text and handle.is_active()
    assert model.weight.dtype is torch.float32
    handle._deactivate()
