"""Model-side changes for O0/O2/O3: cast the weights, cast inputs and outputs, keep some modules fp32.

Everything is done with removable hooks and recorded so ``deinitialize`` can
undo it: forward pre-/post-hooks (no replaced ``forward`` attribute), and for
cast models a state_dict post-hook (the model's state_dict holds the fp32
master values, or fp32 copies without masters, under every name of tied params)
and a load_state_dict pre-hook (loading also updates the masters).
"""
import torch

from .casting.wrappers import FLOAT_DTYPES, HALF_DTYPES, cast_tree
from .module_compat import forward_hook, forward_pre_hook

_BATCHNORM = (torch.nn.modules.batchnorm._BatchNorm,)


def _caster(dtype):
    """Cast floating tensors (fp64 excepted unless dtype is fp64) to ``dtype``."""

    def cast(t):
        dt = t.dtype
        if dt is dtype or dt not in FLOAT_DTYPES or (dt is torch.float64 and dtype in HALF_DTYPES):
            return t
        return t.to(dtype=dtype)

    return cast


def _cast_inputs_once(cast):
    """A forward pre-hook casting the call's tensors, each distinct tensor once: an argument passed several
    times stays one tensor (``MultiheadAttention``'s fused fast path needs ``query is key is value``)."""

    def hook(module, args, kwargs):
        seen = {}  # id -> (source, cast); holding the source keeps its id unique during the call

        def cast_one(t):
            found = seen.get(id(t))
            if found is None:
                found = seen[id(t)] = (t, cast(t))
            return found[1]

        return cast_tree(args, cast_one), cast_tree(kwargs, cast_one)

    return hook


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
        self.handles.append(forward_pre_hook(self.model, _cast_inputs_once(to_in), with_kwargs=True))
        self.handles.append(forward_hook(self.model, lambda m, args, out: cast_tree(out, to_out)))
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

    def link_state_dict(self, masters, to_model=None):
        """state_dict() holds what amp_patch cast in its original dtype under every name (tied params included):
        the fp32 masters where there are (O2), else an upcast copy (O3, as Apex's state_dict hook did).
        load_state_dict() also writes the masters (in place, so tied params stay tied); ``to_model(param,
        master)``, if given, is the half value the model param then gets (else torch's cast of the loaded one)."""
        if not self.original_dtypes and not self.buffers:
            return
        params, buffers = _names_by_id(self.model)
        restored = []  # (name, tensor now in the model, original dtype, master or None)
        for pid, (param, dtype) in self.original_dtypes.items():
            restored += [(name, param, dtype, masters.get(pid)) for name in params.get(pid, ())]
        for module, name, _, dtype in self.buffers:
            restored += [(path + name, None, dtype, None) for path in buffers.get(id(module), ())]

        def state_dict_hook(module, state_dict, prefix, local_metadata):
            for name, _, dtype, master in restored:
                value = state_dict.get(prefix + name)
                if master is not None:
                    state_dict[prefix + name] = master.detach()
                elif isinstance(value, torch.Tensor) and value.dtype is not dtype:
                    state_dict[prefix + name] = value.detach().to(dtype)

        def load_pre_hook(module, state_dict, prefix, *unused):
            with torch.no_grad():
                for name, param, _, master in restored:
                    value = state_dict.get(prefix + name)
                    if master is not None and isinstance(value, torch.Tensor) and value.shape == master.shape:
                        master.copy_(value)
                        if to_model is not None:
                            state_dict[prefix + name] = to_model(param, master)

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


def _names_by_id(model):
    """``{id(param): [every name]}`` and ``{id(module): [every "path." prefix]}``, duplicates (ties) kept."""
    params, modules = {}, {}
    for name, param in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(param), []).append(name)
    for path, module in model.named_modules(remove_duplicate=False):
        modules.setdefault(id(module), []).append(path + "." if path else "")
    return params, modules
