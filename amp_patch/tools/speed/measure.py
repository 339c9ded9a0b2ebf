"""Measure a fix before printing it: the job's own piece against the fixed one, interleaved, on this machine.

- :func:`padding_gain`: a misaligned layer (a copy of the job's own module with its sizes padded to multiples of 8,
  the padding zero) or matmul, forward and backward at the input shape the probe steps recorded, against the
  original.
- :func:`loader_gain`: the job's DataLoader against the same Dataset, sampler and collate function with workers.

A :class:`Gain` is *significant* when the fixed piece was faster in every one of at least three interleaved pairs
(rounds): the report prints a fix only then, with the time it saves per step.
"""
import copy
import dataclasses
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from .shapes import misaligned, padded

PAIRS = 5
MIN_PAIRS = 3


@dataclasses.dataclass
class Gain:
    """``before_ms``/``after_ms``: medians of the original and the fixed piece; ``low``/``high``: the per-pair
    ratios after/before; ``pairs``; ``significant``: every pair faster fixed."""

    before_ms: float
    after_ms: float
    low: float
    high: float
    pairs: int

    @property
    def significant(self):
        return self.pairs >= MIN_PAIRS and self.high < 1.0

    @property
    def saved_ms(self):
        return max(0.0, self.before_ms - self.after_ms)


def forward_backward(fn, *inputs):
    """One forward and backward of ``fn`` (the unit :func:`padding_gain` times; tests inject a slow phase here)."""
    out = fn(*inputs)
    out.float().sum().backward()


def _timed(run, cuda):
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def compare(before, after, cuda=False, pairs=PAIRS):
    """Time two callables in interleaved pairs (one warm-up each, the order alternating); a :class:`Gain`."""
    before(), after()
    times = ([], [])
    for i in range(pairs):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            times[which].append(_timed((before, after)[which], cuda))
    ratios = [b / a for a, b in zip(*times) if a > 0]
    return Gain(statistics.median(times[0]), statistics.median(times[1]), min(ratios, default=1.0),
                max(ratios, default=1.0), len(ratios))


def _padded_module(module):
    """A copy of a Linear or (ungrouped) conv ``module`` with its misaligned sizes padded (zeros), or None."""
    fix = {attr: pad for attr, _, pad in misaligned(module)}
    if not fix or getattr(module, "groups", 1) != 1:
        return None
    twin = copy.deepcopy(module)
    out_size = fix.get("out_features", fix.get("out_channels", module.weight.shape[0]))
    in_size = fix.get("in_features", fix.get("in_channels", module.weight.shape[1]))
    with torch.no_grad():
        weight = module.weight.new_zeros((out_size, in_size, *module.weight.shape[2:]))
        weight[:module.weight.shape[0], :module.weight.shape[1]] = module.weight
        twin.weight = nn.Parameter(weight)
        if module.bias is not None:
            bias = module.bias.new_zeros(out_size)
            bias[:module.bias.shape[0]] = module.bias
            twin.bias = nn.Parameter(bias)
    for attr, pad in fix.items():
        setattr(twin, attr, pad)
    return twin


def _inputs(shape, dtype, dim, size, device):
    grown = list(shape)
    grown[dim] = size
    return (torch.randn(shape, dtype=dtype, device=device, requires_grad=True),
            torch.randn(grown, dtype=dtype, device=device, requires_grad=True))


def padding_gain(module, shape, dtype, device, cuda=False):
    """The module against its padded copy at input ``shape``/``dtype``; None when it cannot be padded here."""
    twin = _padded_module(module)
    if twin is None or not shape:
        return None
    dim = -1 if isinstance(module, nn.Linear) else 1
    x, x_padded = _inputs(shape, dtype, dim, twin.weight.shape[1], device)
    try:
        return compare(lambda: forward_backward(module, x), lambda: forward_backward(twin, x_padded), cuda)
    except (RuntimeError, TypeError):  # a module that does not run detached from its model: not measured
        return None


def matmul_gain(a_shape, b_shape, dtype, device, cuda=False):
    """``a @ b`` against the same product with ``k`` and ``n`` padded to multiples of 8."""
    k, n = a_shape[-1], b_shape[-1]
    a, a_padded = _inputs(a_shape, dtype, -1, padded(k), device)
    b = torch.randn(b_shape, dtype=dtype, device=device, requires_grad=True)
    b_padded = torch.randn((*b_shape[:-2], padded(k), padded(n)), dtype=dtype, device=device, requires_grad=True)
    return compare(lambda: forward_backward(torch.matmul, a, b), lambda: forward_backward(torch.matmul, a_padded,
                                                                                            b_padded), cuda)


def with_workers(loader, workers):
    """A DataLoader over ``loader``'s Dataset, sampler and collate function, with ``workers`` worker processes."""
    options = dict(num_workers=workers, collate_fn=loader.collate_fn, persistent_workers=True,
                   pin_memory=getattr(loader, "pin_memory", False))
    if loader.batch_size is None:
        return DataLoader(loader.dataset, batch_size=None, sampler=loader.sampler, **options)
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **options)


def loader_gain(loader, workers, batches=4, rounds=PAIRS):
    """Per-batch fetch time of the job's loader against :func:`with_workers`, ``rounds`` interleaved rounds of
    ``batches`` batches each (the first batch of a fresh iterator, the workers' start, not counted)."""
    fixed = with_workers(loader, workers)
    times = ([], [])
    try:
        for i in range(rounds):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                times[which].append(_fetch_ms((loader, fixed)[which], batches))
    finally:
        fixed._iterator = None  # ends the persistent workers
        del fixed
    ratios = [b / a for a, b in zip(*times) if a > 0]
    return Gain(statistics.median(times[0]), statistics.median(times[1]), min(ratios, default=1.0),
                max(ratios, default=1.0), len(ratios))


def _fetch_ms(loader, batches):
    """The median time to fetch one batch, over ``batches`` batches after the first."""
    it = iter(loader)
    next(it)
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times) if times else 0.0
