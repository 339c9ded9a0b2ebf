"""What the Fused* optimizers share: Apex's ``zero_grad``/``set_grad_none``, collecting a group's grads,
running the step's closure, state buffers (fp32, or in the param's dtype), one-line notes for arguments that
have no effect here, and argument checks."""
import logging

import torch

from ....errors import ConfigError, UsageError

log = logging.getLogger("amp_patch")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose ``zero_grad()`` follows Apex's ``set_grad_none`` and whose step is foreach math."""

    def __init__(self, params, defaults, set_grad_none):
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none=None):
        """Set grads to None (``set_grad_none=True``, Apex's default for most Fused* classes) or to zero."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _with_grads(self, group):
        """The group's params that have a grad, with their state (checked: dense grad, supported dtype)."""
        name = type(self).__name__
        found = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise UsageError(f"{name} does not support sparse gradients (param of shape {tuple(p.shape)}); "
                                 f"use torch.optim.SparseAdam for sparse embeddings")
            if p.dtype not in SUPPORTED_DTYPES:
                raise UsageError(f"{name} updates float32, float16 and bfloat16 params; got a {p.dtype} param of "
                                 f"shape {tuple(p.shape)}. Use the torch.optim equivalent for other dtypes.")
            found.append((p, self.state[p]))
        return found

    @staticmethod
    def _noop_flag(device):
        return torch.zeros(1, dtype=torch.int, device=device)


def closure_loss(closure):
    """``closure()``'s loss, computed with grad enabled (None without a closure), as torch.optim's step does."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def fp32_buffer(p, state, key):
    """``state[key]``, created as fp32 zeros shaped like ``p`` (fp32 for half params too) on first use."""
    if key not in state:
        state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    return state[key]


def param_dtype_buffer(p, state, key):
    """``state[key]``, created as zeros in ``p``'s own dtype on first use: Apex's ``torch.zeros_like(p)`` state of
    FusedLAMB, FusedAdagrad and FusedNovoGrad (their kernels compute in fp32 and store back in that dtype)."""
    if key not in state:
        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state[key]


def refuse_amsgrad(name, amsgrad):
    if amsgrad:
        raise ConfigError(f"{name}(amsgrad=True): {name} does not support the AMSGrad variant (Apex refused it "
                          f"too); use torch.optim.Adam(amsgrad=True) or drop amsgrad.")


def note_no_effect(name, **given):
    """One INFO line naming the arguments that only tuned Apex's CUDA kernels."""
    if given:
        log.info("%s: %s accepted with no effect (they tuned Apex's CUDA kernels; the foreach math here gives "
                 "the same results)", name, ", ".join(f"{k}={v!r}" for k, v in given.items()))


def advance_step(group):
    """Apex counts steps per param group; a group without grads (e.g. a skipped step) does not advance."""
    group["step"] = group.get("step", 0) + 1
    return group["step"]


def by_device(items):
    """``{device: [(param, state), ...]}``: foreach kernels take tensors of one device."""
    out = {}
    for p, state in items:
        out.setdefault(p.device, []).append((p, state))
    return out


def unscale_for_scaler(optimizer, grad_scaler, devices):
    """Apex's capturable step under torch's GradScaler: False (skip the step) when a grad of ``devices`` is
    inf/NaN, else True after unscaling the grads in place. Without a scaler (or with grads the user already
    unscaled through ``scaler.unscale_``) there is nothing to do."""
    if grad_scaler is None:
        return True
    from torch.amp.grad_scaler import OptState
    state = grad_scaler._per_optimizer_states[id(optimizer)]
    already = state["stage"] is OptState.UNSCALED
    found = state["found_inf_per_device"] if already else grad_scaler._check_inf_per_device(optimizer)
    if any(bool(found[d].item()) for d in devices if d in found):
        return False
    if not already:
        inv_scale = grad_scaler._get_scale_async().double().reciprocal().float()
        for device, pairs in devices.items():
            torch._foreach_mul_([p.grad for p, _ in pairs], inv_scale.to(device))
    return True


def update_targets(pairs, master_weights):
    """The tensors an update writes, and the callable that copies them back: the params themselves, or (Apex's
    ``master_weights=True``) an fp32 master kept in ``state["master_param"]`` for each half param."""
    if not master_weights:
        return [p for p, _ in pairs], lambda: None
    targets = []
    for p, state in pairs:
        if p.dtype in (torch.float16, torch.bfloat16):
            if "master_param" not in state:
                state["master_param"] = p.detach().float().clone()
            targets.append(state["master_param"])
        else:
            targets.append(p)

    def write_back():
        with torch.no_grad():
            for (p, _), target in zip(pairs, targets):
                if target is not p:
                    p.copy_(target)

    return targets, write_back
