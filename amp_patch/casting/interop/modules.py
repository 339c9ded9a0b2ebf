"""torch.nn modules that inspect dtypes or hooks themselves, kept working (and fast) under amp_patch.

* ``RNNBase.check_input`` refuses an input whose dtype differs from the weights' unless *torch's* autocast is
  on, so under O1 a half activation (from a half ``Linear``/conv front end) into an fp32 ``nn.LSTM`` raised.
  The ``torch._VF`` entry the module then calls is wrapped by the O1 engine and casts input, hidden state and
  weights to one dtype, so while that wrapper is installed (and casting is on in this thread) the dtype part of
  the check is answered for the cast dtype; the shape checks still run (:func:`relax_rnn_input_check`).
* ``TransformerEncoderLayer`` runs its fused kernel only when the layer has no forward hooks of its own. Hooks
  amp_patch must attach to such a layer (the model passed to ``initialize``, or every module under
  ``diagnose_overflow=True``) go on torch's global hook lists instead, filtered to that layer
  (:func:`forward_pre_hook`, :func:`forward_hook`). Global pre-hooks see positional arguments only; that layer's
  keyword arguments are masks it converts to the input's dtype itself and ``is_causal``.
"""
from threading import get_ident

import torch
from torch.nn.modules import module as _module_mod

from ...patching.patcher import Patcher

FAST_PATH_TYPES = (torch.nn.TransformerEncoderLayer,)
_VF_OF_MODE = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


def relax_rnn_input_check(engine):
    """Patch ``RNNBase.check_input`` for the engine's session; returns the undo callable."""
    wrapped = {p.name for p in engine.patcher.patches if p.target is torch._VF}
    modes = {mode for mode, fn in _VF_OF_MODE.items() if fn in wrapped}
    patcher = Patcher()
    if modes:
        patcher.install(torch.nn.modules.rnn.RNNBase, "check_input",
                        lambda original: _check_input(original, engine, modes))
    return patcher.restore_all


def _check_input(original, engine, modes):
    disabled = engine.disabled

    def check_input(self, input, batch_sizes):
        weights = self._flat_weights
        if (self.mode in modes and weights and isinstance(input, torch.Tensor) and input.is_floating_point()
                and input.dtype != weights[0].dtype and not (disabled and get_ident() in disabled)):
            # same shape and dims, the weights' dtype, no memory: the _VF wrapper makes the dtypes agree
            input = torch.empty((), dtype=weights[0].dtype, device=input.device).expand(input.shape)
        return original(self, input, batch_sizes)

    return check_input


def forward_pre_hook(module, hook, with_kwargs=False):
    """``module.register_forward_pre_hook`` unless a hook would cost ``module`` its fused fast path.

    ``hook`` has the signature of ``with_kwargs``; on a fast-path module it is called with the positional
    arguments only (and ``{}``) and its returned kwargs are ignored. Returns a removable handle.
    """
    if not isinstance(module, FAST_PATH_TYPES):
        return module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)

    def global_hook(mod, args):
        if mod is not module:
            return None
        if not with_kwargs:
            return hook(mod, args)
        result = hook(mod, args, {})
        return result[0] if result is not None else None

    return _module_mod.register_module_forward_pre_hook(global_hook)


def forward_hook(module, hook, always_call=False):
    """``module.register_forward_hook`` unless a hook would cost ``module`` its fused fast path."""
    return forward_hooks([(module, hook)], always_call)[0]


def forward_hooks(pairs, always_call=False):
    """Forward hooks for many ``(module, hook)`` pairs; returns the handles.

    Modules that are (or sit inside) a fast-path layer share one global hook that looks the module up, so the
    per-call cost does not grow with the number of such modules.
    """
    inside = _fast_path_members(module for module, _ in pairs)
    handles, dispatch = [], {}
    for module, hook in pairs:
        if id(module) in inside:
            dispatch[id(module)] = (module, hook)
        else:
            handles.append(module.register_forward_hook(hook, always_call=always_call))
    if dispatch:
        def global_hook(mod, args, out):
            found = dispatch.get(id(mod))
            return found[1](mod, args, out) if found is not None and found[0] is mod else None

        handles.append(_module_mod.register_module_forward_hook(global_hook, always_call=always_call))
    return handles


def _fast_path_members(modules):
    """ids of the given modules that are, or are inside, a fast-path layer (it checks all of its modules)."""
    inside = set()
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, FAST_PATH_TYPES):
                inside.update(id(m) for m in layer.modules())
    return inside
