"""Model-side changes for O0/O2/O3: cast the weights, cast inputs and outputs, keep some modules fp32.

Everything is done with removable hooks and recorded so ``deinitialize`` can
undo it: forward pre-/post-hooks (no replaced ``forward`` attribute), and for
master weights a state_dict post-hook (the model's state_dict holds the fp32
master values) and a load_state_dict pre-hook (loading also updates the masters).
"""
import torch

from .casting import FLOAT_DTYPES, HALF_DTYPES, cast_tree

_BATCHNORM = (torch.nn.modules.batchnorm._BatchNorm,)


def _caster(dtype):
    """Cast floating tensors (fp64 excepted unless dtype is fp64) to ``dtype``."""

    def cast(t):
        dt = t.dtype
        if dt is dtype or dt not in FLOAT_DTYPES or (dt is torch.float64 and dtype in HALF_DTYPES):
            return t
        return t.to(dtype=dtype)

    return cast


class ModelPatch:
    """The changes made to one model; ``restore`` undoes them."""

    def __init__(self, model):
        self.model = model
        self.handles = []
        self.original_dtypes = {}
        self.buffers = []

    def cast(self, dtype, keep_types):
        """Cast params/buffers to ``dtype`` except modules of ``keep_types`` (which stay as they are).

        Returns ``{id(param): fp32 data}`` for params that changed dtype (zero-copy: the old storage).
        """
        old_data = {}
        for module in self.model.modules():
            if keep_types and isinstance(module, keep_types):
                continue
            for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                if t is None or not t.is_floating_point() or t.dtype is dtype:
                    continue
                if isinstance(t, torch.nn.Parameter):
                    self.original_dtypes.setdefault(id(t), (t, t.dtype))
                    old_data[id(t)] = t.data
                    t.data = t.data.to(dtype)
                else:  # .data keeps the buffer object: restore gives the same tensor back
                    self.buffers.append((module, name, t, t.dtype))
                    t.data = t.data.to(dtype)
        return old_data

    def cast_io(self, input_dtype, output_dtype, keep_types):
        """Cast floating inputs of the model to ``input_dtype`` and its outputs to ``output_dtype``."""
        to_in, to_out = _caster(input_dtype), _caster(output_dtype)
        self.handles.append(self.model.register_forward_pre_hook(
            lambda m, args, kwargs: (cast_tree(args, to_in), cast_tree(kwargs, to_in)), with_kwargs=True))
        self.handles.append(self.model.register_forward_hook(lambda m, args, out: cast_tree(out, to_out)))
        if input_dtype in HALF_DTYPES:
            self._keep_modules_fp32(keep_types, input_dtype)

    def _keep_modules_fp32(self, keep_types, half):
        """User-named fp32 modules (not batchnorm, which takes half input natively) run on fp32 input."""
        extra = tuple(t for t in keep_types if not issubclass(t, _BATCHNORM))
        if not extra:
            return
        to_fp32, to_half = _caster(torch.float32), _caster(half)
        for module in self.model.modules():
            if isinstance(module, extra):
                self.handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs: (cast_tree(args, to_fp32), cast_tree(kwargs, to_fp32)),
                    with_kwargs=True))
                self.handles.append(module.register_forward_hook(lambda m, args, out: cast_tree(out, to_half)))

    def link_masters(self, masters):
        """state_dict() reports the fp32 masters; load_state_dict() also writes them."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        by_name = {names[pid]: master for pid, master in masters.items() if pid in names}

        def state_dict_hook(module, state_dict, prefix, local_metadata):
            for name, master in by_name.items():
                if prefix + name in state_dict:
                    state_dict[prefix + name] = master.detach()

        def load_pre_hook(module, state_dict, prefix, *unused):
            with torch.no_grad():
                for name, master in by_name.items():
                    value = state_dict.get(prefix + name)
                    if isinstance(value, torch.Tensor) and value.shape == master.shape:
                        master.copy_(value)

        self.handles.append(self.model.register_state_dict_post_hook(state_dict_hook))
        self.handles.append(self.model.register_load_state_dict_pre_hook(load_pre_hook))

    def restore(self, masters=None):
        """Remove the hooks and give params/buffers back their dtypes (params get the master values)."""
        while self.handles:
            self.handles.pop().remove()
        masters = masters or {}
        for pid, (param, dtype) in self.original_dtypes.items():
            master = masters.get(pid)
            param.data = master.data if master is not None else param.data.to(dtype)
            if param.grad is not None and param.grad.dtype is not dtype:
                param.grad = None  # a half grad belongs to the half model (and may still be scaled)
        for module, name, buffer, dtype in reversed(self.buffers):
            current = module._buffers.get(name)
            if current is buffer:
                buffer.data = buffer.data.to(dtype)
            elif current is not None:  # the model replaced the buffer while initialized
                module._buffers[name] = current.to(dtype)
        self.original_dtypes.clear()
        self.buffers.clear()
