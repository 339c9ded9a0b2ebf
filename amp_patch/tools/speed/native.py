"""amp_patch's own casting cost: the job's O1 step against native ``torch.autocast`` on the same model, optimizer and
batches, in interleaved rounds (each round initializes O1, times a step, undoes it, then times a native step), with
the casts per step of each. What the ``op_list_overhead`` finding reads."""
import dataclasses
import statistics
import time

import torch

import amp_patch

from ..experiment.variants import CastCounter
from .measure import PAIRS


@dataclasses.dataclass
class Overhead:
    """``amp_ms``/``native_ms``: medians over the rounds; ``low``/``high``: the per-round ratios amp/native;
    ``amp_casts``/``native_casts``: dtype casts in one step of each."""

    amp_ms: float
    native_ms: float
    low: float
    high: float
    rounds: int
    amp_casts: int
    native_casts: int

    @property
    def significant(self):
        """amp_patch slower in every round (at least 3)."""
        return self.rounds >= 3 and self.low > 1.0

    @property
    def extra_ms(self):
        return max(0.0, self.amp_ms - self.native_ms)


def step(mode, model, optimizer, job, batch, half_dtype, device):
    """One training step, ``mode`` "amp_patch" (an O1 session is active) or "native" (torch.autocast; a
    GradScaler's scaling is left out for float16: the step compares the casting). Tests inject a slow phase here."""
    optimizer.zero_grad(set_to_none=True)
    if mode == "native":
        with torch.autocast(torch.device(device).type, dtype=half_dtype):
            loss = job.loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
    else:
        loss = job.loss_fn(model(*batch[:-1]), batch[-1])
        with amp_patch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
    optimizer.step()


def measure(model, optimizer, job, batches, half_dtype, device, op_lists=None, rounds=PAIRS):
    """The :class:`Overhead` of O1 (with ``op_lists``) against native autocast; the model and optimizer are left
    as they were given (no session). ``batches``: a callable returning the next batch on the device."""
    cuda = torch.device(device).type == "cuda"
    times, casts = {"amp_patch": [], "native": []}, {}
    for number in range(rounds + 1):  # round 0: warm-up and cast count, not timed
        for mode in ("amp_patch", "native") if number % 2 else ("native", "amp_patch"):
            if mode == "amp_patch":
                amp_patch.initialize(model, optimizer, opt_level="O1", half_dtype=half_dtype, op_lists=op_lists,
                                     verbosity=0)
            try:
                batch = batches()
                if number == 0:
                    with CastCounter() as counter:
                        step(mode, model, optimizer, job, batch, half_dtype, device)
                    casts[mode] = counter.casts
                    continue
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step(mode, model, optimizer, job, batch, half_dtype, device)
                if cuda:
                    torch.cuda.synchronize()
                times[mode].append((time.perf_counter() - start) * 1e3)
            finally:
                if mode == "amp_patch":
                    amp_patch.deinitialize()
    ratios = [a / b for a, b in zip(times["amp_patch"], times["native"]) if b > 0]
    return Overhead(statistics.median(times["amp_patch"]), statistics.median(times["native"]), min(ratios),
                    max(ratios), len(ratios), casts["amp_patch"], casts["native"])
