"""torch.nn modules that inspect dtypes or hooks themselves, kept working (and fast) under amp_patch.

* ``RNNBase.check_input`` refuses an input whose dtype differs from the weights' unless *torch's* autocast is
  on, so under O1 a half activation (from a half ``Linear``/conv front end) into an fp32 ``nn.LSTM`` raised.
  The ``torch._VF`` entry the module then calls is wrapped by the O1 engine and casts input, hidden state and
  weights to one dtype, so while that wrapper is installed (and casting is on in this thread) the dtype part of
  the check is answered for the cast dtype; the shape checks still run (:func:`relax_rnn_input_check`).
* ``Module.load_state_dict`` first forgets a forward of this thread cut off by Ctrl-C (no hook ran at its end), so
  its casts of the old weights are not what a submodule called on its own computes with after the load
  (:func:`forget_cut_off_forward_on_load`; an optimizer step does the same at its start).

The forward-hook helpers that keep ``TransformerEncoderLayer``'s fused fast path are in :mod:`amp_patch._torch.hooks`.
"""
import functools
from threading import get_ident

import torch

_VF_OF_MODE = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


def relax_rnn_input_check(engine, patcher):
    """Patch ``RNNBase.check_input`` for the engine's session through ``patcher`` (its ``restore_all`` undoes it)."""
    wrapped = {p.name for p in engine.patcher.patches if p.target is torch._VF
               and getattr(getattr(p.replacement, "_amp_patch_entry", None), "category", None) != "native_off"}
    modes = {mode for mode, fn in _VF_OF_MODE.items() if fn in wrapped}
    if modes:
        patcher.install(torch.nn.modules.rnn.RNNBase, "check_input",
                        lambda original: _check_input(original, engine, modes))


def forget_cut_off_forward_on_load(engine, patcher):
    """Patch ``Module.load_state_dict`` to call ``engine.drop_cut_off()`` first, through ``patcher`` (its
    ``restore_all`` undoes it)."""

    def make(original):
        @functools.wraps(original)
        def load_state_dict(self, *args, **kwargs):
            if engine.outer_calls:
                engine.drop_cut_off()
            return original(self, *args, **kwargs)
        return load_state_dict

    patcher.install(torch.nn.Module, "load_state_dict", make)


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
