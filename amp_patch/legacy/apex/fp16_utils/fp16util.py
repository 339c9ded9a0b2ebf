"""Apex's fp16 helper functions (``apex.fp16_utils.fp16util``): casting networks and keeping fp32 master copies
by hand. Casts change ``param.data`` in place (the objects stay the same), as Apex's did."""
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network", "FP16Model",
           "prep_param_lists", "model_grads_to_master_grads", "master_params_to_model_params", "to_python_float",
           "clip_grad_norm"]

_BATCHNORM = torch.nn.modules.batchnorm._BatchNorm

#: Apex exported torch's clipping function under this name.
clip_grad_norm = torch.nn.utils.clip_grad_norm_


class tofp16(torch.nn.Module):  # noqa: N801 - Apex's name
    """A module that casts its input to fp16 (the first stage of :func:`network_to_half`)."""

    def forward(self, input):
        return input.half()


def BN_convert_float(module):  # noqa: N802 - Apex's name
    """Put every affine batch norm inside ``module`` back to fp32 (in place); returns ``module``."""
    if isinstance(module, _BATCHNORM) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network):
    """``Sequential(tofp16(), network in fp16 with fp32 batch norms)``."""
    return torch.nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module, dtype):
    """Cast ``module``'s own floating params (and their grads) and buffers to ``dtype``, not its children's."""
    for param in module.parameters(recurse=False):
        if param is not None and param.is_floating_point():
            param.data = param.data.to(dtype=dtype)
            if param.grad is not None and param.grad.is_floating_point():
                param.grad.data = param.grad.data.to(dtype=dtype)
    for _name, buf in module.named_buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network, dtype):
    """Cast every module of ``network`` to ``dtype`` except affine batch norms; returns ``network``."""
    for module in network.modules():
        if isinstance(module, _BATCHNORM) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(torch.nn.Module):
    """Apex's wrapper: the network in fp16 (batch norms fp32), inputs cast to fp16."""

    def __init__(self, network):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        return self.network(*(t.half() for t in inputs))


def prep_param_lists(model, flat_master=False):
    """Return ``(model_params, master_params)``: the trainable params and fp32 copies of them
    (``flat_master=True``: one flat fp32 master holding them all, with a grad buffer)."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        flat = _flatten_dense_tensors([p.data for p in model_params]).float()
        master = torch.nn.Parameter(flat)
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    master_params = [torch.nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, master_params


def model_grads_to_master_grads(model_params, master_params, flat_master=False):
    """Copy the model grads into the fp32 master grads (a model param without a grad clears its master's)."""
    if flat_master:
        master_params[0].grad.data.copy_(_flatten_dense_tensors([p.grad.data for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
        elif master.grad is None:
            master.grad = model.grad.detach().float()
        else:
            master.grad.data.copy_(model.grad.data)


def master_params_to_model_params(model_params, master_params, flat_master=False):
    """Copy the fp32 master values into the model params (rounded to their dtype)."""
    with torch.no_grad():
        if flat_master:
            for model, master in zip(model_params, _unflatten_dense_tensors(master_params[0].data, model_params)):
                model.copy_(master)
            return
        for model, master in zip(model_params, master_params):
            model.copy_(master.data)


def to_python_float(t):
    """A Python number from a one-element tensor (or the first element of a sequence)."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]
