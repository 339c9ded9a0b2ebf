"""Stand-in for Apex's ``amp_C`` extension: the multi-tensor kernels scripts call, on ``torch._foreach_*``.

Every function has the extension's signature ``fn(chunk_size, noop_flag, tensor_lists, *args)`` (call it
directly or through ``apex.multi_tensor_apply.multi_tensor_applier``); ``chunk_size`` is accepted and
ignored (torch's foreach kernels chunk on their own). ``noop_flag`` is Apex's overflow buffer, an int
tensor of one element: ``multi_tensor_scale``, ``multi_tensor_axpby`` and ``multi_tensor_l2norm`` set it
to 1 (on the device, no host sync) when they meet inf/NaN, and ``multi_tensor_sgd`` does nothing while it
is set, as Apex's kernels did. The optimizer kernels (adam, lamb, novograd, adagrad) compute in fp32 and
write results back in each tensor's own dtype. The math follows Apex's published kernels; the Fused*
optimizers in :mod:`amp_patch.legacy.apex.optimizers` are built on these functions.
"""
import math

import torch

__all__ = ["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_scale",
           "multi_tensor_unscale_l2norm", "update_scale_hysteresis",
           "multi_tensor_adam",
           "multi_tensor_sgd", "multi_tensor_lamb", "multi_tensor_novograd", "multi_tensor_adagrad"]


# -- helpers ----------------------------------------------------------------------------------------
def _flag_nonfinite(noop_flag, tensors):
    """Set ``noop_flag`` to 1 if any tensor holds inf/NaN (device-side; no host sync)."""
    if not tensors:
        return
    peaks = torch._foreach_norm(tensors, float("inf"), dtype=torch.float32)
    bad = torch.logical_not(torch.isfinite(torch.stack(peaks))).any()
    noop_flag.masked_fill_(bad.to(noop_flag.device), 1)


def _fp32(tensors):
    """The tensors as fp32 (themselves when already fp32, else fp32 copies)."""
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def _write_back(targets, values):
    """Copy fp32 ``values`` into the ``targets`` they were converted from (a no-op where they are one)."""
    pairs = [(t, v) for t, v in zip(targets, values) if t is not v]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])


def _bias_corrections(beta1, beta2, step, bias_correction):
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1 ** step, 1.0 - beta2 ** step


def _adam_update(g, p, m, v, betas, corrections, eps, mode, weight_decay):
    """Advance the moments ``m``, ``v`` in place and return Adam's update ``m_hat / (sqrt(v_hat) + eps)``.

    ``betas`` is ``(beta1, weight of the grad in m, beta2)``, ``corrections`` the bias corrections
    ``(bc1, bc2)``; mode 0 adds L2 decay to the grad (a new list: ``g`` may be the caller's grads), mode 1
    adds decoupled decay to the update.
    """
    beta1, beta3, beta2 = betas
    bc1, bc2 = corrections
    if mode == 0 and weight_decay != 0:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=beta3)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m, bc1)
    torch._foreach_div_(update, denom)
    if mode == 1 and weight_decay != 0:
        torch._foreach_add_(update, p, alpha=weight_decay)
    return update


# -- elementwise --------------------------------------------------------------------------------------
def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out[i] = in[i] * scale`` for ``tensor_lists = [in, out]``; flags inf/NaN in the inputs."""
    src, dst = tensor_lists
    if not src:
        return
    _flag_nonfinite(noop_flag, src)
    with torch.no_grad():
        scaled = torch._foreach_mul(_fp32(src), float(scale))
        torch._foreach_copy_(dst, scaled)


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    """``out = a*x + b*y`` for ``[x, y, out]``; flags inf/NaN in x (0), y (1) or both (-1)."""
    xs, ys, outs = tensor_lists
    if not xs:
        return
    checked = {0: xs, 1: ys}.get(arg_to_check, list(xs) + list(ys))
    _flag_nonfinite(noop_flag, checked)
    with torch.no_grad():
        result = torch._foreach_mul(_fp32(xs), float(a))
        torch._foreach_add_(result, torch._foreach_mul(_fp32(ys), float(b)))
        torch._foreach_copy_(outs, result)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """Return ``(total_norm, per_tensor_norms)``: fp32 tensors of shape [1] and [n] ([0] unless per_tensor)."""
    tensors = tensor_lists[0]
    device = tensors[0].device if tensors else noop_flag.device
    if not tensors:
        return torch.zeros(1, device=device), torch.empty(0, device=device)
    with torch.no_grad():
        norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        total = torch.linalg.vector_norm(norms).reshape(1)
        noop_flag.masked_fill_(torch.logical_not(torch.isfinite(total)).any().to(noop_flag.device), 1)
    return total, norms if per_tensor else torch.empty(0, device=device)


def multi_tensor_l2norm_scale(chunk_size, noop_flag, tensor_lists, scale, per_tensor=False):
    """:func:`multi_tensor_l2norm` of the inputs of ``[in, out]`` and :func:`multi_tensor_scale` into ``out``."""
    norms = multi_tensor_l2norm(chunk_size, noop_flag, [tensor_lists[0]], per_tensor)
    multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale)
    return norms


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    """:func:`multi_tensor_l2norm` of ``tensors * inv_scale`` (``inv_scale``: a one-element tensor or a number);
    the tensors are left as they are."""
    tensors = tensor_lists[0]
    factor = inv_scale.reshape(-1)[0].float() if isinstance(inv_scale, torch.Tensor) else float(inv_scale)
    with torch.no_grad():
        scaled = torch._foreach_mul([t.float() for t in tensors], factor) if tensors else []
    return multi_tensor_l2norm(chunk_size, noop_flag, [scaled], per_tensor)


def update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                            backoff_factor, growth_interval, hysteresis):
    """Apex's scale update with hysteresis, in place on one-element tensors (scale fp32, trackers int32, found_inf
    fp32): an inf decrements the hysteresis tracker and backs the scale off once it reaches 0; ``growth_interval``
    clean steps in a row grow it (never to inf); a clean step resets the hysteresis tracker. A back-off below the
    smallest normal fp32 gives 0, as Apex's kernel (fast math flushes subnormals). Returns the scale."""
    found = bool(found_inf.item() > 0)
    with torch.no_grad():
        if found:
            hysteresis_tracker.sub_(1)
            if hysteresis_tracker.item() > 0:
                growth_tracker.zero_()
                return current_scale
            current_scale.mul_(backoff_factor)
            # Apex's kernel is built with --use_fast_math: a subnormal result is flushed to 0
            current_scale.masked_fill_(current_scale.abs() < torch.finfo(torch.float32).tiny, 0.0)
            growth_tracker.zero_()
        else:
            successful = int(growth_tracker.item()) + 1
            if successful == growth_interval:
                grown = current_scale * growth_factor
                if bool(torch.isfinite(grown).all()):
                    current_scale.copy_(grown)
                growth_tracker.zero_()
            else:
                growth_tracker.fill_(successful)
            hysteresis_tracker.fill_(hysteresis)
    return current_scale


# -- optimizer kernels ---------------------------------------------------------------------------
def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode, bias_correction,
                      weight_decay):
    """Adam on ``[grads, params, exp_avg, exp_avg_sq]``; mode 0: L2 (decay added to the grad), 1: AdamW."""
    grads, params, exp_avg, exp_avg_sq = tensor_lists
    if not grads:
        return
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    with torch.no_grad():
        g, p, m, v = _fp32(grads), _fp32(params), _fp32(exp_avg), _fp32(exp_avg_sq)
        update = _adam_update(g, p, m, v, (beta1, 1 - beta1, beta2), (bc1, bc2), eps, mode, weight_decay)
        torch._foreach_add_(p, update, alpha=-lr)
        for target, value in ((params, p), (exp_avg, m), (exp_avg_sq, v)):
            _write_back(target, value)


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum, dampening, lr, nesterov,
                     first_run, wd_after_momentum, scale=1.0):
    """SGD on ``[grads, params, momentum_buffers]`` (a 4th list receives a copy of the new params).

    Grads are multiplied by ``scale`` first; nothing happens while ``noop_flag`` is set (Apex's skip).
    """
    grads, params, moms = tensor_lists[:3]
    if not grads or bool(noop_flag.item()):
        return
    with torch.no_grad():
        g, p = torch._foreach_mul(_fp32(grads), float(scale)), _fp32(params)
        if weight_decay != 0 and not wd_after_momentum:
            torch._foreach_add_(g, p, alpha=weight_decay)
        if momentum != 0:
            m = _fp32(moms)
            if first_run:
                torch._foreach_copy_(m, g)
            else:
                torch._foreach_mul_(m, momentum)
                torch._foreach_add_(m, g, alpha=1 - dampening)
            if nesterov:
                torch._foreach_add_(g, m, alpha=momentum)
            else:
                g = [t.clone() for t in m]
            _write_back(moms, m)
        if weight_decay != 0 and wd_after_momentum:
            torch._foreach_add_(g, p, alpha=weight_decay)
        torch._foreach_add_(p, g, alpha=-lr)
        _write_back(params, p)
        if len(tensor_lists) > 3:
            torch._foreach_copy_(tensor_lists[3], p)


def multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, bias_correction,
                      weight_decay, grad_averaging, mode, global_grad_norm, max_grad_norm, use_nvlamb=False):
    """LAMB on ``[grads, params, exp_avg, exp_avg_sq]`` (Apex's two stages; grads are left unchanged).

    Stage 1: grads divided by ``global_grad_norm / max_grad_norm`` when the norm exceeds ``max_grad_norm``,
    Adam moments (``grad_averaging``: (1-beta1) on the grad, else 1), update = m_hat / (sqrt(v_hat) + eps)
    with L2 (mode 0) or decoupled (mode 1) weight decay. Stage 2: p -= lr * trust_ratio * update, the trust
    ratio ||p|| / ||update|| applied when ``use_nvlamb`` or weight_decay != 0 and both norms are nonzero.
    """
    grads, params, exp_avg, exp_avg_sq = tensor_lists
    if not grads:
        return
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    with torch.no_grad():
        gnorm = torch.as_tensor(global_grad_norm, dtype=torch.float32, device=grads[0].device).reshape(())
        clip = torch.where(gnorm > max_grad_norm, gnorm / max_grad_norm, torch.ones_like(gnorm))
        g, p, m, v = _fp32(grads), _fp32(params), _fp32(exp_avg), _fp32(exp_avg_sq)
        g = torch._foreach_div(g, clip)
        update = _adam_update(g, p, m, v, (beta1, beta3, beta2), (bc1, bc2), eps, mode, weight_decay)
        update = _rounded_like_grads(update, grads, params)
        torch._foreach_mul_(update, _trust_ratios(p, update, lr, weight_decay, use_nvlamb))
        torch._foreach_sub_(p, update)
        for target, value in ((params, p), (exp_avg, m), (exp_avg_sq, v)):
            _write_back(target, value)


def _rounded_like_grads(update, grads, params):
    """Apex's single-dtype LAMB kernel stores stage 1's update into the grad: where grad and param share a half
    dtype, the update is rounded to it before its norm and stage 2 (an fp32 master with half grads: left fp32)."""
    return [u.to(g.dtype).float() if g.dtype == q.dtype and g.dtype != torch.float32 else u
            for u, g, q in zip(update, grads, params)]


def _trust_ratios(params, updates, lr, weight_decay, use_nvlamb):
    if not (use_nvlamb or weight_decay != 0):
        return [torch.tensor(float(lr), device=t.device) for t in params]
    p_norms = torch._foreach_norm(params, 2, dtype=torch.float32)
    u_norms = torch._foreach_norm(updates, 2, dtype=torch.float32)
    return [torch.where((pn != 0) & (un != 0), lr * (pn / un), torch.full_like(pn, lr))
            for pn, un in zip(p_norms, u_norms)]


def multi_tensor_novograd(chunk_size, noop_flag, tensor_lists, grad_norms, lr, beta1, beta2, eps, step,
                          bias_correction, weight_decay, grad_averaging, moment_mode, norm_type):
    """NovoGrad on ``[grads, params, exp_avg]`` with per-tensor second moments ``grad_norms`` (updated in place).

    ``grad_norms`` blend: L2 (norm_type 2) ``sqrt(beta2*n_old**2 + (1-beta2)*n**2)``, inf (0) ``beta2*n_old +
    (1-beta2)*n``. bias_correction2 is ``sqrt(1 - beta2**step)``. moment_mode 0: the normalised grad plus decay
    enters the moment; 1: decay is added to the update.
    """
    grads, params, exp_avg = tensor_lists
    if not grads:
        return
    bc1, bc2 = 1.0, 1.0
    if bias_correction:
        bc1, bc2 = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)
    beta3 = 1 - beta1 if grad_averaging else 1.0
    with torch.no_grad():
        new = torch.stack(torch._foreach_norm(grads, 2 if norm_type == 2 else float("inf"), dtype=torch.float32))
        if norm_type == 2:
            grad_norms.copy_(torch.sqrt(beta2 * grad_norms * grad_norms + (1 - beta2) * new * new))
        else:
            grad_norms.copy_(beta2 * grad_norms + (1 - beta2) * new)
        denoms = [(n / bc2 + eps).to(g.device) for n, g in zip(grad_norms.unbind(0), grads)]
        g, p, m = _fp32(grads), _fp32(params), _fp32(exp_avg)
        if moment_mode == 0:
            g = torch._foreach_div(g, denoms)
            if weight_decay != 0:
                torch._foreach_add_(g, p, alpha=weight_decay)
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, g, alpha=beta3)
        update = torch._foreach_div(m, bc1)
        if moment_mode != 0:
            torch._foreach_div_(update, denoms)
            if weight_decay != 0:
                torch._foreach_add_(update, p, alpha=weight_decay)
        torch._foreach_add_(p, update, alpha=-lr)
        _write_back(params, p)
        _write_back(exp_avg, m)


def multi_tensor_adagrad(chunk_size, noop_flag, tensor_lists, lr, eps, mode, weight_decay):
    """Adagrad on ``[grads, params, sums]``; mode 0: L2 decay added to the grad, 1: decoupled decay."""
    grads, params, sums = tensor_lists
    if not grads:
        return
    with torch.no_grad():
        g, p, h = _fp32(grads), _fp32(params), _fp32(sums)
        if mode == 0 and weight_decay != 0:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        torch._foreach_addcmul_(h, g, g)
        denom = torch._foreach_sqrt(h)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(g, denom)
        if mode == 1 and weight_decay != 0:
            torch._foreach_add_(update, p, alpha=weight_decay)
        torch._foreach_add_(p, update, alpha=-lr)
        _write_back(params, p)
        _write_back(sums, h)
