"""The shape of a public GAN trainer's Apex code (DeepPrivacy's loss optimizer; the script itself needs
torchvision, absent here): a generator and a discriminator passed together with one FusedAdam each
(``betas=(0.0, 0.99)``) to ``amp.initialize(..., num_losses=3, max_loss_scale=2**17)``; each loss its own
``loss_id``; grads cleared with ``param.grad = None``; several losses on one graph (``retain_graph``); a
gradient penalty (``autograd.grad(..., create_graph=True)``) inside ``scale_loss``; the discriminator's
``requires_grad`` switched off for the generator's step. Trains under O1 and O2 under the apex alias with finite
losses, and the O1 run matches the same program in fp32 closely (the penalty's double backward included)."""
import pytest
import torch

from amp_patch import legacy


def _nets():
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 6))
    disc = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))
    return gen, disc


def _penalty(disc, real, fake):
    alpha = torch.rand(real.shape[0], 1)
    mixed = (alpha * real + (1 - alpha) * fake.float()).requires_grad_(True)
    grad, = torch.autograd.grad(disc(mixed).float().sum(), mixed, create_graph=True)
    return (grad.float().norm(dim=1) - 1).pow(2).mean()


def _backward(amp, losses, model, optimizer, offset):
    for p in model.parameters():
        p.grad = None
    for i, loss in enumerate(losses):
        scale = amp.scale_loss(loss, optimizer, loss_id=offset + i) if amp else None
        if scale is None:
            loss.backward(retain_graph=i < len(losses) - 1)
            continue
        with scale as scaled:
            scaled.backward(retain_graph=i < len(losses) - 1)
    optimizer.step()


def _train(amp, level=None, steps=6):
    from amp_patch.legacy.apex.optimizers import FusedAdam

    gen, disc = _nets()
    g_opt = FusedAdam(gen.parameters(), lr=1e-3, betas=(0.0, 0.99))
    d_opt = FusedAdam(disc.parameters(), lr=1e-3, betas=(0.0, 0.99))
    if amp:
        [gen, disc], [g_opt, d_opt] = amp.initialize([gen, disc], [g_opt, d_opt], opt_level=level, num_losses=3,
                                                     max_loss_scale=2.0 ** 17, verbosity=0)
    data = torch.Generator().manual_seed(1)
    log = []
    for _ in range(steps):
        real, z = torch.randn(16, 6, generator=data), torch.randn(16, 4, generator=data)
        with torch.no_grad():
            fake = gen(z)
        d_real, d_fake = disc(real).float(), disc(fake).float()
        wasserstein = d_fake.mean() - d_real.mean()
        _backward(amp, [wasserstein, 10 * _penalty(disc, real, fake)], disc, d_opt, 0)
        for p in disc.parameters():
            p.requires_grad = False
        g_loss = -disc(gen(z)).float().mean()
        _backward(amp, [g_loss], gen, g_opt, 2)
        for p in disc.parameters():
            p.requires_grad = True
        log.append((wasserstein.item(), g_loss.item()))
    params = [p for opt in (g_opt, d_opt) for p in amp.master_params(opt)] if amp else [
        *gen.parameters(), *disc.parameters()]  # (O2: the fp32 masters)
    weights = [p.detach().float().clone() for p in params]
    return log, weights


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_gan_shape_with_a_gradient_penalty_trains_under_the_alias(level):
    with legacy.install_apex_alias():
        from apex import amp

        try:
            log, weights = _train(amp, level)
            scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
        finally:
            legacy.amp.deinitialize()
    start = [p.detach() for net in _nets() for p in net.parameters()]
    assert all(torch.isfinite(torch.tensor(entry)).all() for entry in log)
    moved = [not torch.equal(a, b) for a, b in zip(weights, start)]
    assert moved == [True] * 7 + [False]  # (the critic's output bias gets a zero grad from both of its losses)
    assert len(scales) == 3 and all(s <= 2.0 ** 17 for s in scales)
    if level == "O1":  # (CPU O1 casts to float16: close to the fp32 program)
        _, fp32 = _train(None)
        assert max((a - b).abs().max().item() for a, b in zip(weights, fp32)) < 5e-3
