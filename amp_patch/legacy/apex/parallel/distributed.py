"""``apex.parallel.distributed``: Apex's DistributedDataParallel on torch's, ``Reducer`` and ``flat_dist_call``.

:class:`DistributedDataParallel` is a ``torch.nn.parallel.DistributedDataParallel`` built from Apex's
constructor arguments. Arguments that only tuned how Apex scheduled its all-reduces (``message_size``,
``allreduce_trigger_params``, ``retain_allreduce_buffers``, ``num_allreduce_streams``,
``allreduce_communicators``, ``prof``) are accepted with one INFO line: torch's reducer gives the same
gradients. ``delay_allreduce=True`` (Apex's mode that tolerates params without a grad) becomes torch's
``find_unused_parameters=True``. Arguments that change the gradients are honoured through a DDP
communication hook with Apex's arithmetic: ``gradient_average=False`` (sum instead of mean),
``gradient_predivide_factor`` (grads times 1/f before the all-reduce, times f/world_size after it when
averaging) and ``allreduce_always_fp32`` (half buckets reduced in fp32).
``shared_param`` is refused, as Apex refused it.
"""
import logging

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ....errors import ConfigError
from .sync_batchnorm import SyncBatchNorm

log = logging.getLogger("amp_patch")

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call", "apply_flat_dist_call", "split_by_type",
           "split_half_float_double", "flatten", "unflatten"]

flatten = _flatten_dense_tensors
unflatten = _unflatten_dense_tensors

_NO_EFFECT_DEFAULTS = dict(message_size=10000000, allreduce_trigger_params=None,
                           retain_allreduce_buffers=False, num_allreduce_streams=1, allreduce_communicators=None,
                           prof=False)


# -- flat collective helpers --------------------------------------------------------------------------
def split_by_type(tensors):
    """``{(device, dtype): [tensor, ...]}`` in first-seen order: tensors that can share one flat buffer."""
    buckets = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    return buckets


def split_half_float_double(tensors):
    """The tensors as lists of fp16, fp32 and fp64 tensors (Apex's helper; empty lists dropped)."""
    lists = [[t for t in tensors if t.dtype == dt] for dt in (torch.float16, torch.float32, torch.float64)]
    return [lst for lst in lists if lst]


def apply_flat_dist_call(bucket, call, extra_args=None):
    """Flatten ``bucket`` (one device and dtype), run ``call(flat, *extra_args)``, copy the result back.

    An all-reduce is divided by the world size (Apex's flat_dist_call averaged)."""
    coalesced = flatten(bucket)
    call(coalesced, *(extra_args or ()))
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    with torch.no_grad():
        for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
            buf.copy_(synced)


def flat_dist_call(tensors, call, extra_args=None):
    """Run the collective ``call`` (e.g. ``dist.broadcast`` with ``extra_args=(0,)``, or ``dist.all_reduce``,
    which then averages) on ``tensors`` with one flat buffer per device and dtype."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


class Reducer:
    """Apex's manual gradient averager: ``Reducer(module)`` broadcasts rank 0's state at construction;
    ``reduce()`` after backward averages the grads over the ranks. ``Reducer(list_of_grads)`` averages
    those tensors instead."""

    def __init__(self, module_or_grads_list):
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module = module_or_grads_list
            flat_dist_call([t.data for t in self.module.state_dict().values()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads = list(module_or_grads_list)

    def reduce(self):
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        flat_dist_call(grads, dist.all_reduce)


# -- DistributedDataParallel ------------------------------------------------------------------------
class _ApexReduction:
    """Comm hook state: Apex's all-reduce arithmetic for one DDP module."""

    def __init__(self, group, average, predivide, always_fp32):
        self.group, self.average, self.predivide, self.always_fp32 = group, average, predivide, always_fp32


def _apex_allreduce_hook(state, bucket):
    buf = bucket.buffer()
    tensor = buf.float() if state.always_fp32 and buf.dtype != torch.float32 else buf
    if state.predivide != 1.0:
        tensor.mul_(1.0 / state.predivide)
    world = dist.get_world_size(state.group)
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()

    def finish(fut):
        out = fut.value()[0]
        if state.average and state.predivide != world:
            out.mul_(state.predivide / world)
        if out is not buf:
            buf.copy_(out)
        return buf

    return fut.then(finish)


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """Apex's ``DistributedDataParallel(module, ...)`` signature on torch's DDP (see the module docstring)."""

    def __init__(self, module, message_size=10000000, delay_allreduce=False, shared_param=None,
                 allreduce_trigger_params=None, retain_allreduce_buffers=False, allreduce_always_fp32=False,
                 num_allreduce_streams=1, allreduce_communicators=None, gradient_average=True,
                 gradient_predivide_factor=1.0, gradient_average_split_factor=None, prof=False):
        if shared_param is not None:
            raise ConfigError(f"DistributedDataParallel(shared_param={shared_param!r}): Apex removed this option; "
                              "shared parameters work without it. Drop it (pass delay_allreduce=True if you meant "
                              "to all-reduce only after the whole backward pass).")
        predivide = _predivide(gradient_predivide_factor, gradient_average_split_factor)
        given = dict(message_size=message_size, allreduce_trigger_params=allreduce_trigger_params,
                     retain_allreduce_buffers=retain_allreduce_buffers, num_allreduce_streams=num_allreduce_streams,
                     allreduce_communicators=allreduce_communicators, prof=prof)
        changed = {k: v for k, v in given.items() if v is not _NO_EFFECT_DEFAULTS[k]
                   and v != _NO_EFFECT_DEFAULTS[k]}
        if changed:
            log.info("apex.parallel.DistributedDataParallel: %s accepted with no effect (they scheduled Apex's "
                     "own all-reduces; torch's DDP reducer gives the same gradients)",
                     ", ".join(f"{k}={_short(v)}" for k, v in changed.items()))
        if delay_allreduce:
            log.info("apex.parallel.DistributedDataParallel: delay_allreduce=True -> torch DDP with "
                     "find_unused_parameters=True (params without a grad are tolerated, as by Apex's delayed "
                     "all-reduce)")
        super().__init__(module, find_unused_parameters=bool(delay_allreduce))
        self.delay_allreduce = bool(delay_allreduce)
        self.gradient_average = bool(gradient_average)
        self.gradient_predivide_factor = predivide
        self.allreduce_always_fp32 = bool(allreduce_always_fp32)
        if not self.gradient_average or predivide != 1.0 or self.allreduce_always_fp32:
            self.register_comm_hook(_ApexReduction(self.process_group, self.gradient_average, predivide,
                                                   self.allreduce_always_fp32), _apex_allreduce_hook)

    def _passing_sync_batchnorm_handle(self, module):
        # torch's DDP refuses every SyncBatchNorm on CPU; this package's SyncBatchNorm all-reduces its statistics
        # itself there (gloo), so only other SyncBatchNorm layers meet torch's check.
        torch_only = torch.nn.ModuleList(layer for layer in module.modules()
                                         if isinstance(layer, torch.nn.SyncBatchNorm)
                                         and not isinstance(layer, SyncBatchNorm))
        super()._passing_sync_batchnorm_handle(torch_only)

    def __del__(self):
        # torch's gloo group joins its worker threads in its destructor. When the C++ reducer holds the group's last
        # reference (the script called destroy_process_group() before its model went), that destructor runs with
        # the GIL held, and a worker that needs the GIL to drop the tensors of its last finished work never
        # returns: the process hangs at exit (about 1 exit in 25 on 2 CPU ranks). Dropping the reducer (and the
        # logger that shares it) first leaves the last reference to this module's Python process_group object,
        # whose destructor releases the GIL before joining.
        for name in ("logger", "reducer"):
            self.__dict__.pop(name, None)


def _short(value):
    """repr for a log line; a list of params or communicators is summarised by its length."""
    if isinstance(value, (list, tuple)):
        return f"[{len(value)} items]"
    return repr(value)


def _predivide(factor, split_factor):
    if split_factor is not None:
        log.warning("apex.parallel.DistributedDataParallel: gradient_average_split_factor is Apex's old name of "
                    "gradient_predivide_factor; using gradient_predivide_factor=%r", split_factor)
        factor = split_factor
    try:
        value = float(factor)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"DistributedDataParallel(gradient_predivide_factor={factor!r}): pass a positive finite "
                          f"number (grads are multiplied by 1/factor before the all-reduce)")
    return value
