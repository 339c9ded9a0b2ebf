"""Grads are unscaled by the scale their loss was multiplied by, even where another block's exit changed the loss
scaler's scale in between (amp_patch's API and Apex's alike: Apex unscaled by the exit's scale, docs/migration.md).

Two optimizers sharing a ``loss_id`` share its scaler. An overflow in one optimizer's block halves the scale (and a
clean streak doubles it) while the other optimizer's grads are still scaled: accumulated by an earlier
``delay_unscale`` block, or produced by an outer block whose loss was scaled before the inner block exited. Those
grads carry the old scale: unscaling them by the new one trains on grads off by the ratio, silently. The generator
runs random programs of such blocks twice, at a dynamic scale and at a static scale of 1.0 (O0: fp32 model, so a
power-of-two scale is exact), and asserts the params are bitwise the same after every step.
"""
import random

import pytest
import torch

import amp_patch
from amp_patch import legacy

APIS = {"amp_patch": amp_patch, "apex": legacy.amp}


def _loss(model, x, inf):
    loss = model(x).pow(2).mean()
    return loss * float("inf") if inf else loss


def _run_block(amp, models, optimizers, block, xs):
    i, loss_id, delay, inf, inner = block
    loss = _loss(models[i], xs[i], inf)
    with amp.scale_loss(loss, optimizers[i], loss_id=loss_id, delay_unscale=delay) as scaled:
        if inner is not None:  # (the outer loss was scaled at entry; the inner block exits before its backward)
            _run_block(amp, models, optimizers, inner, xs)
        scaled.backward()


def _run(program, loss_scale, api):
    torch.manual_seed(program["seed"])
    models = [torch.nn.Linear(4, 3) for _ in range(program["n_opts"])]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    amp = APIS[api]
    extra = {"growth_interval": 2} if api == "amp_patch" else {}  # (Apex's API grows after 2000 clean steps)
    models, optimizers = amp.initialize(models, optimizers, opt_level="O0", loss_scale=loss_scale, num_losses=2,
                                        verbosity=0, **extra)
    trace = []
    try:
        for s, blocks in enumerate(program["steps"]):
            torch.manual_seed(100 * program["seed"] + s)
            xs = [torch.randn(5, 4) for _ in models]
            for opt in optimizers:
                opt.zero_grad()
            for block in blocks:
                _run_block(amp, models, optimizers, block, xs)
            for opt in optimizers:
                opt.step()
            trace.append([p.detach().clone() for m in models for p in m.parameters()])
    finally:
        amp_patch.deinitialize()
    return trace


def _block(rng, n_opts, free):
    i = rng.choice(free)
    inner = None
    rest = [j for j in free if j != i]
    if rest and rng.random() < 0.3:
        inner = _block(rng, n_opts, rest)
    return (i, rng.choice((0, 0, 1)), rng.random() < 0.4, rng.random() < 0.25, inner)


def _program(seed):
    rng = random.Random(seed)
    n_opts = rng.choice((2, 3))
    steps = [[_block(rng, n_opts, list(range(n_opts))) for _ in range(rng.randint(2, 5))] for _ in range(4)]
    return {"seed": seed, "n_opts": n_opts, "steps": steps}


def _agree(program, api="amp_patch"):
    scaled, plain = _run(program, "dynamic", api), _run(program, 1.0, api)
    for s, (a, b) in enumerate(zip(scaled, plain)):
        for p, q in zip(a, b):
            if not torch.equal(p, q):
                return f"step {s}: params differ (max ratio {(p / q).abs().max().item():.3g})"
    return None


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("seed", range(16))
def test_random_blocks_on_optimizers_sharing_a_scaler_train_as_at_a_scale_of_one(seed, api):
    program = _program(seed)
    assert _agree(program, api) is None, program


@pytest.mark.parametrize("api", APIS)
def test_delayed_grads_keep_their_scale_when_another_optimizers_overflow_halves_it(api):
    # opt 0 and opt 1 accumulate (delay_unscale); then opt 0's loss overflows (the scale halves at its exit) before
    # opt 1's unscaling block: opt 1's first grads carry the old scale
    program = {"seed": 7, "n_opts": 2, "steps": [[(0, 0, True, False, None), (1, 0, True, False, None),
                                                  (0, 0, False, True, None), (1, 0, False, False, None)]] * 2}
    assert _agree(program, api) is None


@pytest.mark.parametrize("api", APIS)
def test_an_outer_blocks_grads_keep_their_scale_when_an_inner_block_changes_it(api):
    program = {"seed": 3, "n_opts": 2, "steps": [[(1, 0, False, False, (0, 0, False, True, None))]] * 3}
    assert _agree(program, api) is None
