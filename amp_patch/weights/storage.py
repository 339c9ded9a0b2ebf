"""How O2 holds its fp32 master weights: a master-storage strategy per optimizer.

* :class:`Fp32Masters` (``master_weights=True``): an fp32 master per half param, kept between steps; after each
  step it is copied to the model with round-to-nearest-even (torch's cast, the default) or, with
  ``master_rounding="split"``, with the split rule below.
* :class:`RemainderMasters` (``master_weights="remainder"``, bfloat16 only): between steps the master is the
  bf16 model weight plus an int16 remainder held here; the fp32 master exists only inside ``optimizer.step()``:
  joined before the (unchanged) optimizer runs, split back after, then freed with its fp32 grad.

The split rule. An fp32 bit pattern is ``high16 << 16 | low16``. The bf16 weight is ``high16 + (low16 >=
0x8000)`` (round half away from zero on the low 16 bits) and the remainder is ``low16`` read as a signed int16,
so ``(bf16 << 16) + remainder`` (32-bit two's complement) is the fp32 pattern again: the split is lossless for
every finite and infinite value. A NaN master keeps its high half with the quiet bit set (no rounding step), so
its weight is NaN and the join is NaN again (NaN payloads are not kept bit for bit). Torch's
round-to-nearest-even differs from this rule only at exact ties (``low16 == 0x8000``).

The strategies differ only in where the fp32 value lives between steps; the grad path (half grads unscaled into
fp32 master grads at each ``scale_loss`` exit, accumulated there across micro-batches) is the same, which is
why ``"remainder"`` is bitwise identical to ``master_weights=True, master_rounding="split"``.
"""
import logging
import sys

import torch

from ..errors import UsageError

log = logging.getLogger("amp_patch")

_LITTLE = sys.byteorder == "little"


def _halves(bits32):
    """(low16, high16) int16 views of a contiguous 32-bit tensor (no copy)."""
    pairs = bits32.view(torch.int16).view(-1, 2)
    return (pairs[:, 0], pairs[:, 1]) if _LITTLE else (pairs[:, 1], pairs[:, 0])


def split_(master, weight, remainder, nan_safe=True):
    """Write the bf16 half of fp32 ``master`` into ``weight`` and its int16 remainder into ``remainder``.

    ``nan_safe=False``: the caller checked that every element is finite (:func:`all_finite`) and gives up
    ``master`` (its bits are changed): three contiguous passes instead of five. Setting the lowest bit makes
    torch's round-to-nearest-even round an exact tie up (away from zero) and changes nothing else for finite
    values; an inf would become a NaN, hence the check."""
    nan_safe = nan_safe or not master.is_contiguous()
    bits = master.detach().contiguous().view(torch.int32).view(-1)
    rem = remainder.view(-1)
    rem.copy_(bits)  # int32 -> int16 keeps the low 16 bits, two's complement
    if not nan_safe:
        bits.bitwise_or_(1)
        weight.copy_(master.detach())
        return
    w16 = weight.view(torch.int16).view(-1)
    high = _halves(bits)[1]
    torch.sub(high, rem >> 15, out=w16)  # a negative remainder: the weight rounded up by one
    w16.copy_(torch.where(torch.isnan(master.detach()).reshape(-1), high | 0x0040, w16))


def all_finite(tensors):
    """Is every element of ``tensors`` finite? One host sync for all (through their sums: a sum that overflows
    to inf only sends the caller down its slower exact path)."""
    sums = [t.detach().sum() for t in tensors]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


def round_split(master):
    """The bf16 weight the split rule gives ``master`` (a new tensor)."""
    weight = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    split_(master, weight, torch.empty(master.shape, dtype=torch.int16, device=master.device))
    return weight


def join(weight, remainder):
    """The fp32 value ``weight`` (bf16) and ``remainder`` (int16) stand for (a new tensor): the bf16 bits moved
    to the high half (torch's exact bf16 -> fp32 cast), plus the remainder as a 32-bit integer."""
    out = weight.detach().float()
    out.view(torch.int32).add_(remainder.view(out.shape))
    return out


def split(master):
    """(bf16 weight, int16 remainder) of fp32 ``master``: ``join(*split(m))`` equals ``m`` bit for bit."""
    weight = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    remainder = torch.empty(master.shape, dtype=torch.int16, device=master.device)
    split_(master, weight, remainder)
    return weight, remainder


class Fp32Masters:
    """Masters kept in fp32 between steps; ``rounding`` says how they are copied to the half model."""

    persistent = True

    def __init__(self, rounding="nearest"):
        self.rounding = rounding

    def adopt(self, model_p, master):
        if self.rounding == "split":
            with torch.no_grad():
                model_p.copy_(round_split(master))

    def before_step(self, pairs):
        pass

    def after_step(self, pairs, skipped):
        if skipped or not pairs:
            return
        with torch.no_grad():
            if self.rounding == "split":
                for model_p, master in pairs:
                    model_p.copy_(round_split(master))
            else:
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def public(self, model_p, master):
        return master

    def to_model(self, model_p, master):
        """The value ``model_p`` gets from ``master`` (after a load or a broadcast)."""
        return round_split(master) if self.rounding == "split" else master.detach().to(model_p.dtype)

    def out_of_sync(self, model_p, master):
        return not torch.equal(self.to_model(model_p, master), model_p.detach())


class RemainderMasters:
    """bf16 model weight + int16 remainder between steps; the fp32 master only inside ``step()``."""

    persistent = False

    def __init__(self):
        self.remainders = {}  # id(master) -> int16 tensor
        self.live = set()  # id(master) of masters joined now (inside step())
        self.marks = {}  # id(master) -> (model param's _version, checksum) when amp_patch last wrote it
        self.warned_edit = False  # (an in-place edit of a weight is reported once per optimizer)

    def adopt(self, model_p, master):
        if model_p.dtype is not torch.bfloat16:
            raise UsageError(f"master_weights='remainder' needs bfloat16 model params; this one is {model_p.dtype}. "
                             "Use half_dtype=torch.bfloat16, or master_weights=True")
        remainder = torch.empty(master.shape, dtype=torch.int16, device=master.device)
        if not model_p.is_contiguous():  # split and join work on the flat 16-bit words
            model_p.data = model_p.data.contiguous()
        with torch.no_grad():
            split_(master.detach(), model_p.data, remainder)
        self.remainders[id(master)] = remainder
        self._mark(model_p, master, checksum=True)
        _free(master)

    def before_step(self, pairs):
        """Join every master (also for a skipped step: an optimizer may read params it does not update). A step
        nested in a step (a subclass's ``step()`` calling ``super().step()`` runs torch's step hooks twice) finds
        its masters joined already."""
        for model_p, master in pairs:
            if id(master) not in self.live:  # (OptimizerState carried in-place edits just before)
                master.data = join(model_p, self.remainders[id(master)])
                self.live.add(id(master))

    def after_step(self, pairs, skipped):
        live = [(model_p, master) for model_p, master in pairs if id(master) in self.live]
        if not skipped and live:  # (the outer end of a nested step finds them split and freed already)
            nan_safe = not all_finite([master for _, master in live])
            with torch.no_grad():
                for model_p, master in live:
                    split_(master.data, model_p.data, self.remainders[id(master)], nan_safe)
                    self._mark(model_p, master)
        self.release(pairs)

    def carry_edit(self, model_p, master):
        """A weight written in place since amp_patch last split it (``p.data.clamp_``, ``zero_()``, a submodule's
        ``load_state_dict``) no longer matches its remainder, and the pre-edit weight is not kept, so which elements
        changed cannot be told: the master becomes the edited bf16 weight exactly (remainder zeroed). Edited
        elements get the edited value, as with fp32 masters; unedited elements of that param lose their low 16
        bits (fp32 masters keep them). Logged once per optimizer; ``master_weights=True`` keeps edits exact."""
        if id(master) in self.live or not self._edited(model_p, master):
            return
        self.remainders[id(master)].zero_()
        self._mark(model_p, master)
        if not self.warned_edit:
            self.warned_edit = True
            log.warning("master_weights='remainder': a %s model weight of shape %s was changed in place since the "
                        "last step; its master is now that bf16 weight (its unedited elements lose their low 16 bits). "
                        "For exact in-place edits (WGAN clipping, weight surgery) use master_weights=True, or edit "
                        "through amp_patch.master_params(optimizer) inside a step", model_p.dtype, tuple(model_p.shape))

    def _edited(self, model_p, master):
        version, checksum = self.marks[id(master)]
        return not torch.equal(_checksum(model_p), checksum)  # (.data writes do not move the version)

    def release(self, pairs):
        """Drop the fp32 masters and their grads (between steps only the bf16 weight and the remainder stay)."""
        for _, master in pairs:
            _free(master)
            master.grad = None
        self.live.clear()

    def value(self, model_p, master):
        if id(master) in self.live:
            return master.detach()
        self.carry_edit(model_p, master)
        return join(model_p, self.remainders[id(master)])

    def load(self, model_p, master, value):
        """Make ``value`` (any float dtype) the exact master: split it into the model weight and the remainder."""
        with torch.no_grad():
            fp32 = value.detach().to(device=model_p.device, dtype=torch.float32)
            split_(fp32, model_p.data, self.remainders[id(master)])
            if id(master) in self.live:
                master.data.copy_(fp32)
        self._mark(model_p, master, checksum=True)  # (load_state_dict then copies the same weight in again)

    def _mark(self, model_p, master, checksum=True):
        self.marks[id(master)] = (model_p._version, _checksum(model_p))

    def out_of_sync(self, model_p, public):
        """Was ``model_p`` written outside amp_patch (e.g. DDP's broadcast of rank 0's weights) since amp_patch
        last wrote it? Then the remainder belongs to another weight. The version counter tells; after a load or
        at initialize a checksum tells a copy of the same values (DDP broadcasting equal weights) from others."""
        version, checksum = self.marks[id(public._master)]
        if model_p._version == version:
            return False
        return checksum is None or not torch.equal(_checksum(model_p), checksum)

    def public(self, model_p, master):
        return JoinedMaster(self, model_p, master)

    def to_model(self, model_p, master):
        return model_p.detach().clone()


def _checksum(weight):
    """Two int64 sums of the 16-bit words (all, and every other one): no temporary copy."""
    words = weight.detach().view(torch.int16).view(-1)
    return torch.stack([words.sum(dtype=torch.int64), words[::2].sum(dtype=torch.int64)])


def _free(master):
    """Leave ``master`` its shape (so grads can be assigned and clipped) over one fp32 element of storage, a NaN:
    its value is not there between steps, and reading it must not look like a weight of zero."""
    master.data = torch.full((), float("nan"), dtype=torch.float32, device=master.device).expand(master.shape)


class JoinedMaster:
    """What the model's state_dict(), load_state_dict(), deinitialize and the DDP helpers see as a remainder
    master: reading gives the exact fp32 value (joined on demand), ``copy_`` splits a value back in."""

    def __init__(self, storage, model_p, master):
        self._storage, self._model_p, self._master = storage, model_p, master

    shape = property(lambda self: self._master.shape)
    dtype = property(lambda self: torch.float32)
    device = property(lambda self: self._model_p.device)
    grad = property(lambda self: self._master.grad)

    @property
    def data(self):
        return self._storage.value(self._model_p, self._master)

    def detach(self):
        return self.data

    def to(self, *args, **kwargs):
        return self.data.to(*args, **kwargs)

    def copy_(self, value):
        self._storage.load(self._model_p, self._master, value)
        return self


def make_storage(master_storage, rounding):
    """The storage strategy for the resolved ``master_storage`` ('fp32' or 'remainder') and ``master_rounding``."""
    if master_storage == "remainder":
        return RemainderMasters()
    return Fp32Masters(rounding or "nearest")
