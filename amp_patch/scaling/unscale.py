"""Unscaling gradients: multiply by 1/scale and detect inf/NaN with at most one host sync per call.

Grads are grouped by (device, dtype) for torch's fused ``_amp_foreach_non_finite_check_and_unscale_``;
a static scale of 1.0 only checks (one read pass). ``unscale_into`` writes fp32 results into (or adds them
to) separate tensors: the O2 master grads.
"""
import logging
import threading
from collections.abc import MutableSequence

import torch

from ..errors import UsageError

logger = logging.getLogger("amp_patch")
_NO_KERNEL = set()  # device types where torch lacks _amp_foreach_non_finite_check_and_unscale_
_CPU = torch.device("cpu")
_get_num_threads = torch.get_num_threads


def _check_tensor(where, tensor):
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise UsageError(f"{where} is a {type(tensor).__name__}; expected a torch.Tensor or None.")


_Tensor = torch.Tensor


def _group(tensors):
    """Return ``{device: {dtype: [tensor, ...]}}`` of the distinct tensors (sparse: their values)."""
    tensors = tensors if isinstance(tensors, list) else list(tensors)
    if tensors and _plain_alike(tensors):  # the common case, found in one pass: one group as it is
        return {tensors[0].device: {tensors[0].dtype: tensors}}
    groups, seen = {}, set()
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if tensor.is_sparse:
            tensor = tensor._values()
        if hasattr(tensor, "to_local"):  # a DTensor (FSDP2's sharded grads): this rank's shard, same storage
            tensor = tensor.to_local()
        groups.setdefault(tensor.device, {}).setdefault(tensor.dtype, []).append(tensor)
    return groups


def _plain_alike(tensors):
    """Distinct strided plain tensors, all of one device and dtype (property reads only: a method call would show in
    ``amp_patch.trace()``'s report of unpatched calls)."""
    first = tensors[0]
    dtype, device, strided = first.dtype, first.device, torch.strided
    for tensor in tensors:
        if (type(tensor) is not _Tensor or tensor.dtype is not dtype or tensor.layout is not strided
                or tensor.device != device):
            return False
    return len(set(map(id, tensors))) == len(tensors)


def _check_and_unscale_group(tensors, found, inv_tensor, inv_scale):
    device_type = tensors[0].device.type
    if device_type not in _NO_KERNEL:
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_tensor)
            return
        except NotImplementedError:
            _NO_KERNEL.add(device_type)
            logger.debug("no fused unscale kernel for %s tensors; using the foreach fallback", device_type)
    flags = torch.stack([torch.logical_not(torch.isfinite(t)).any() for t in tensors])
    found.add_(flags.any().to(found.dtype))
    torch._foreach_mul_(tensors, inv_scale)


def _any_nonfinite(groups):
    """Scale 1.0 (e.g. bf16): nothing to multiply, only the check. A per-tensor fp32 sum is finite only if the
    tensor holds no inf/NaN: one read pass instead of read+write. A non-finite sum may also come from finite values
    summing beyond 3.4e38, so the caller confirms a True with the exact check."""
    flags = []
    for _device, by_dtype in groups.items():
        sums = [t.sum(dtype=torch.float32) for tensors in by_dtype.values() for t in tensors]
        flags.append(torch.isfinite(torch.stack(sums)).all().logical_not().reshape(1))
    if len(flags) > 1:
        first = flags[0].device
        flags = [torch.cat([f.to(first) for f in flags]).any()]
    return bool(flags[0].item()) if flags else False


_READ_ONLY_MIN = 1 << 18  # elements; below this the one fused kernel wins (measured on a 2-core CPU)


def _numel(groups):
    return sum(_count(tensors) for by_dtype in groups.values() for tensors in by_dtype.values())


def _count(tensors):
    return sum(t.numel() for t in tensors)


_INVERSES = {}  # (device, 1/scale) -> that one-element fp32 tensor: read-only to the kernels, made once


def _inverse(device, inv_scale):
    tensor = _INVERSES.get((device, inv_scale))
    if tensor is None:
        if len(_INVERSES) >= 64:  # a dynamic scale visits a few powers of two; stay bounded anyway
            _INVERSES.clear()
        tensor = _INVERSES[(device, inv_scale)] = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
    return tensor


_FLAGS = threading.local()  # .flags: device -> this thread's found-inf flag, zeroed before each use


def _found_flag(device):
    """A zeroed one-element fp32 flag on ``device`` for the kernel to set; one per thread and device, reused (each
    use ends with the host reading it, so no kernel can still be writing it when the next use zeroes it)."""
    flags = getattr(_FLAGS, "flags", None)
    if flags is None:
        flags = _FLAGS.flags = {}
    flag = flags.get(device)
    if flag is None:
        with torch.inference_mode(False):  # (made inside inference_mode, its zero_() outside would be refused)
            flag = flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
        return flag
    return flag.zero_()


def _unscale_groups(groups, scale):
    """Unscale every tensor of ``groups`` in place; one host sync for the found-inf flag."""
    if scale == 1.0 and torch.get_num_threads() > 1 and _numel(groups) > _READ_ONLY_MIN:
        if not _any_nonfinite(groups):  # large: a parallel read-only pass beats the fused read+write kernel
            return False
        # inf/NaN, or finite grads whose sum overflows fp32 (rare): the exact check below decides (x * 1.0 == x)
    inv_scale = 1.0 / scale
    founds = []
    for device, by_dtype in groups.items():
        found = _found_flag(device)
        inv_tensor = _inverse(device, inv_scale)
        for tensors in by_dtype.values():
            _check_and_unscale_group(tensors, found, inv_tensor, inv_scale)
        founds.append(found)
    if not founds:
        return False
    if len(founds) > 1:
        first = founds[0].device
        founds = [torch.cat([f.to(first) for f in founds]).sum()]
    return bool(founds[0].item())


def unscale_(grads, scale):
    """Multiply each tensor of ``grads`` by ``1/scale`` in place; return True if any was inf/NaN.

    ``None`` entries are skipped, a tensor listed twice is unscaled once, and
    tensors may mix dtypes (fp16/bf16/fp32/fp64) and devices.
    """
    grads = list(grads)
    for i, grad in enumerate(grads):
        _check_tensor(f"grads[{i}]", grad)
    return _unscale_groups(_group([g for g in grads if g is not None]), float(scale))


def unscale_usual_(grads, scale):
    """:func:`unscale_collected_` for a non-empty list of grads with no None, in one frame where it is the usual
    model's: distinct dense plain tensors of one device and dtype, small enough for the one fused kernel (every step
    of the usual loop comes here, once backward has run).

    At a scale of 1.0 it is a check only: ``x * 1.0 == x``, so neither a grad listed twice nor a mix of dtypes needs
    grouping; plain tensors of one device are all the one kernel call needs, and what it refuses (a sparse grad:
    NotImplementedError; a non-strided one: RuntimeError) it may have checked in part without changing anything,
    so the general path then checks every grad again. A CPU check at 1.0 (bfloat16's usual case) reads no device
    object: measured, the reads below cost a step several microseconds once backward has run."""
    if scale == 1.0 and grads[0].is_cpu and not _NO_KERNEL:
        for grad in grads:
            if type(grad) is not _Tensor or not grad.is_cpu:
                return unscale_collected_(grads, 1.0)
        if _get_num_threads() > 1 and _count(grads) > _READ_ONLY_MIN:
            return unscale_collected_(grads, 1.0)
        found = _pooled_check(grads, _CPU, 1.0, (NotImplementedError, RuntimeError))
        return unscale_collected_(grads, 1.0) if found is None else found
    device = grads[0].device
    if device.type in _NO_KERNEL:
        return unscale_collected_(grads, scale)
    if scale != 1.0:
        if not _plain_alike(grads):
            return unscale_collected_(grads, scale)
        found = _pooled_check(grads, device, 1.0 / scale, NotImplementedError)
        # (None: no kernel for this device type; the general path falls back and says so)
        return unscale_collected_(grads, scale) if found is None else found
    if device.type == "cpu":
        for grad in grads:
            if type(grad) is not _Tensor or not grad.is_cpu:
                return unscale_collected_(grads, 1.0)
    elif not _plain_alike(grads):
        return unscale_collected_(grads, 1.0)
    if torch.get_num_threads() > 1 and _count(grads) > _READ_ONLY_MIN:
        return unscale_collected_(grads, 1.0)
    found = _pooled_check(grads, device, 1.0, (NotImplementedError, RuntimeError))
    return unscale_collected_(grads, 1.0) if found is None else found


_POOL = threading.local()  # device -> this thread's found-inf flag on it, in the pool only while it holds 0.0


def _pooled_check(grads, device, inv_scale, refused):
    """The fused kernel over ``grads`` (one device) with a flag that needs no ``zero_()`` (a kernel launch): the
    kernel only ever sets a flag, so one read as 0.0 goes back to the pool as it is, and one that saw inf/NaN, or
    whose use raised anywhere, is never seen again. True if any grad was inf/NaN; None if the kernel raised one of
    ``refused`` (the caller's general path then checks every grad)."""
    pool = _POOL.__dict__
    flag = pool.pop(device, None)
    if flag is None:
        with torch.inference_mode(False):  # (a flag made inside inference_mode could not be written outside it)
            flag = torch.zeros(1, dtype=torch.float32, device=device)
    inverse = _INVERSES.get((device, inv_scale))
    if inverse is None:
        inverse = _inverse(device, inv_scale)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inverse)
    except refused:
        return None
    if flag.item():
        return True
    pool[device] = flag
    return False


def unscale_collected_(grads, scale):
    """:func:`unscale_` for grads amp_patch collected itself from ``param.grad`` (tensors or None), no type checks, as
    the check before a step: also the sums an optimizer forms of a sparse grad (:func:`_sums_overflow`; not in
    :func:`unscale_`, which rescales grads between two scales on their way, where those sums are not read yet)."""
    grads = [g for g in grads if g is not None]
    return _unscale_groups(_group(grads), float(scale)) or _sums_overflow(grads)


def _sums_overflow(grads):
    """An uncoalesced float16 sparse grad (an index looked up twice) holds finite values whose per-index sums, the
    grad as a dense float16 grad would hold it and as ``coalesce()`` forms it (SparseAdam, Adagrad), can be inf: two
    values of 4e4. So its coalesced values are checked too, after the unscale, as GradScaler coalesces float16 sparse
    grads before its check. Other dtypes have fp32's range: their sums overflow only where fp32 sums would, and
    coalescing a large embedding's grad every step costs more than its step."""
    for grad in grads:
        if grad.dtype is torch.float16 and grad.layout is torch.sparse_coo and not grad.is_coalesced():
            if not bool(torch.isfinite(grad.coalesce()._values()).all()):
                return True
    return False


def _check_out(grads, out):
    if len(out) != len(grads):
        raise UsageError(f"out has {len(out)} entries but grads has {len(grads)}; pass one out slot per grad.")
    for i, (grad, target) in enumerate(zip(grads, out)):
        _check_tensor(f"grads[{i}]", grad)
        _check_tensor(f"out[{i}]", target)
        if grad is None:
            continue
        if target is None and not isinstance(out, MutableSequence):
            raise UsageError(f"out[{i}] is None, so a new tensor must be stored there, but out is a "
                             f"{type(out).__name__}; pass a list.")
        if target is not None and target.shape != grad.shape:
            raise UsageError(f"out[{i}] has shape {tuple(target.shape)} but grads[{i}] has shape "
                             f"{tuple(grad.shape)}.")


def unscale_into(grads, out, scale):
    """Write ``grads[i].float() / scale`` into ``out[i]``; return True if any grad was inf/NaN.

    ``out[i] is None``: a new fp32 tensor (on the grad's device) is stored in
    ``out[i]`` (``out`` must then be a list). Otherwise the unscaled value is
    *added* to the existing ``out[i]`` (gradient accumulation into fp32 master
    grads). ``grads`` are left untouched; ``None`` grads leave ``out[i]`` as is.
    The overflow check covers the new contributions only.
    """
    grads = list(grads)
    _check_out(grads, out)
    pending = [(i, g.detach().to(torch.float32, copy=True)) for i, g in enumerate(grads) if g is not None]
    found = _unscale_groups(_group([tmp for _, tmp in pending]), float(scale))
    fused = {}
    for i, tmp in pending:
        target = out[i]
        if target is None:
            out[i] = tmp
        elif target.device == tmp.device and not (target.is_sparse or tmp.is_sparse):
            group = fused.setdefault(target.device, ([], []))
            group[0].append(target)
            group[1].append(tmp)
        else:
            target.add_(tmp.to(target.device))
    for targets, tmps in fused.values():
        torch._foreach_add_(targets, tmps)
    return found
