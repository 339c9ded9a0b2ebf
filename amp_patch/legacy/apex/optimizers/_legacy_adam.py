"""FusedAdam before October 2019: ``FusedAdam(..., eps_inside_sqrt=False, weight_decay=0., max_grad_norm=0.)`` and
``step(grads=, output_params=, scale=, grad_norms=)``, as Hugging Face's pytorch-pretrained-BERT 0.6 used it
(with ``FP16_Optimizer``). The update is that version's kernel's::

    g = grad / combined_scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    denom = sqrt(v + eps) if eps_inside_sqrt else sqrt(v) + eps
    p -= step_size * (m / denom + weight_decay * p),  step_size = lr sqrt(1-b2^t) / (1-b1^t) (or lr)

``combined_scale`` is ``scale``, times ``(norm / scale + 1e-6) / max_grad_norm`` when that exceeds 1, where
``norm`` is ``grad_norms[group]`` (the norm of the scaled grads) or, when not given (a plain ``step()``, e.g. from
``FP16_Optimizer`` on unscaled fp32 master grads), the group's grad norm computed here. ``output_params`` receive
a copy of the new params (in their own dtype)."""
import math
import types

import torch


def _per_group(value, groups):
    """Apex's old convention: None, one flat list (a single group), or one list per group."""
    if value is None:
        return [None] * len(groups)
    if isinstance(value, types.GeneratorType):
        return [list(value)]
    value = list(value)
    return [value] if value and not isinstance(value[0], (list, tuple)) else value


def _combined_scale(group, grads, scale, norm):
    if group["max_grad_norm"] <= 0:
        return scale
    if norm is None:
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    clip = ((norm / scale) + 1e-6) / group["max_grad_norm"]
    return clip * scale if clip > 1 else scale


def legacy_step(optimizer, grads=None, output_params=None, scale=1.0, grad_norms=None):
    groups = optimizer.param_groups
    for group, g_list, out_list, norm in zip(groups, _per_group(grads, groups), _per_group(output_params, groups),
                                             grad_norms if grad_norms is not None else [None] * len(groups)):
        g_list = g_list if g_list is not None else [None] * len(group["params"])
        out_list = out_list if out_list is not None else [None] * len(group["params"])
        items = [(p, g if g is not None else p.grad, out) for p, g, out in zip(group["params"], g_list, out_list)
                 if g is not None or p.grad is not None]
        if items:
            _update_group(optimizer, group, items, _combined_scale(group, [g for _, g, _ in items], scale, norm))


def _update_group(optimizer, group, items, combined_scale):
    beta1, beta2 = group["betas"]
    with torch.no_grad():
        for p, grad, out in items:
            state = optimizer.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            step = state["step"]
            step_size = group["lr"]
            if group["bias_correction"]:
                step_size = group["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
            g = grad.float() / combined_scale
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
            p32 = p.float()
            p32.sub_((m / denom + group["weight_decay"] * p32) * step_size)
            p.copy_(p32)
            if out is not None:
                out.copy_(p32)
