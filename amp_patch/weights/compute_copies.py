"""O2's weights have one owner: the model's registered fp32 parameters. Half weights are compute copies.

For each outermost call of a model amp_patch cast (O2, ``master_weights=True``), :class:`ComputeCopies` puts a
half copy of every cast parameter into ``module._parameters`` for the duration of the call and the registered
fp32 parameters back when it returns *or raises* (a forward hook with ``always_call``). A copy is
``param.to(half)``, a non-leaf of the fp32 parameter: autograd carries its grad back into ``param.grad`` in fp32,
so grads accumulate in fp32 on the parameter itself. A parameter used under several names (tied weights) is cast
once per call. This is the layout of FSDP2's ``MixedPrecisionPolicy``.

Between calls the model holds only its fp32 parameters: every optimizer (closures, wrappers that step an inner
optimizer), EMA copy, ``load_state_dict`` (of the model or of a submodule), ``clip_grad_norm_(model.parameters())``,
in-place edit and ``deepcopy`` sees the one value there is; nothing is kept in step by hooks.

Params of modules kept fp32 (``keep_batchnorm_fp32``, ``keep_fp32_modules``) are not copied. Modules added after
initialize get copies from their next call on (the registration watch re-collects the slots). An RNN's
``_flat_weights`` are rebuilt around the swap. An in-place edit of a copy during the call (``nn.Embedding``'s
``max_norm``, a forward pre-hook clamping weights) is written back into the fp32 param when the call ends (edits
through ``.data`` bypass the version counter and stay on the copy: edit the params between steps). Calls of one
model from several threads take turns: one thread's call holds the copies until it returns.
The slots are shared with :class:`~.transform.WeightSlots`, so
the input cast follows the weights the forward uses (a deepcopy of the model, whose hooks are inert, runs in
fp32 on fp32 inputs).
"""
import threading
import time

import torch
from torch.nn.modules import module as _module_mod

from .._torch.hooks import FAST_PATH_TYPES, SessionHook, forward_pre_hook
from ..config.dtypes import FLOAT_DTYPES
from ..errors import UsageError

#: How long a call from a second thread waits for another thread's call of an O2 model to end, polling.
THREAD_WAIT_S, POLL_S = 60.0, 0.0005


class _Turn:
    """Which thread's calls hold compute copies: one thread at a time, across every O2 model (two models that
    share a module would otherwise each wait for the other's thread). A plain C lock guards the two fields and is
    never held while waiting (a waiting thread polls): an interrupt cannot leave it taken, as it can a
    ``threading.Condition`` whose Python-level ``__enter__`` is interrupted after acquiring."""

    def __init__(self):
        self.lock = threading.Lock()
        self.thread = None
        self.depth = 0  # calls of O2 models in progress in that thread

    def enter(self, called):
        if torch.compiler.is_compiling():  # (dynamo traces the hooks: the compiled call runs in one thread's call)
            return
        me = threading.get_ident()
        deadline = None
        while not self._take(me):
            now = time.monotonic()
            deadline = deadline or now + THREAD_WAIT_S
            if now > deadline:
                raise UsageError(
                    f"{type(called).__name__}: a call of an O2 model from thread {me} waited {THREAD_WAIT_S:.0f} s "
                    f"for thread {self.thread}'s call to end. O2 puts the half compute copies into the model for "
                    "the length of one call, so calls from several threads take turns; a forward that calls O2 "
                    "modules from threads it starts and waits for cannot. Call them from the forward's own "
                    "thread, or run that model under O1.")
            time.sleep(POLL_S)

    def _take(self, me):
        with self.lock:
            if self.thread not in (None, me):
                return False
            self.thread = me
            self.depth += 1
            return True

    def holds(self):
        return torch.compiler.is_compiling() or self.thread == threading.get_ident()

    def leave(self):
        if torch.compiler.is_compiling():
            return
        with self.lock:
            self.depth = max(self.depth - 1, 0)
            if not self.depth:
                self.thread = None

    def reset(self):
        """deinitialize: this thread has no call of an O2 model in progress any more (one an interrupt cut short
        left its turn taken)."""
        with self.lock:
            if self.thread == threading.get_ident():
                self.thread, self.depth = None, 0


TURN = _Turn()


class _Install(SessionHook):
    def __init__(self, owner):
        self.owner = owner

    def __call__(self, module, args):
        self.owner.install(module)


class _Restore(SessionHook):
    def __init__(self, owner):
        self.owner = owner

    def __call__(self, module, args, output):
        self.owner.uninstall()


class _RestoreOf(SessionHook):
    """Global forward hook filtered to one fast-path layer (a hook of its own would cost it its fused kernel)."""

    def __init__(self, model, owner):
        self.model, self.owner = model, owner

    def __call__(self, module, args, output):
        if module is self.model:
            self.owner.uninstall()


class ComputeCopies:
    """Per model: half compute copies of its fp32 params for each outermost call (see the module docstring).
    ``slots`` is the :class:`~.transform.WeightSlots` list of ``(module, name)`` it fills."""

    def __init__(self, model, dtype, keep_types, watch, slots):
        self.model, self.dtype, self.keep_types, self.watch = model, dtype, keep_types, watch
        self.slots = slots
        self.generation = None
        self.depth = 0
        self.swapped = []  # (module, name, fp32 param, half copy, its version) of the call in progress
        self.handles = []

    def attach(self):
        self._collect()
        if isinstance(self.model, FAST_PATH_TYPES):  # (global hooks, in registration order: before the input cast)
            self.handles.append(forward_pre_hook(self.model, _Install(self)))
            self.handles.append(_module_mod.register_module_forward_hook(_RestoreOf(self.model, self),
                                                                         always_call=True))
            return self
        self.handles.append(self.model.register_forward_pre_hook(_Install(self), prepend=True))
        self.handles.append(self.model.register_forward_hook(_Restore(self), prepend=True, always_call=True))
        self._hook_owners()
        return self

    def _hook_owners(self):
        """The modules that own cast params get the same hooks: called on their own (a submodule called
        directly, a checkpointed segment recomputed during backward) they swap their own params; inside an
        outer call they only count the depth. Not inside a fast-path layer (its hooks would cost the kernel)."""
        inside = {id(m) for layer in self.model.modules() if isinstance(layer, FAST_PATH_TYPES) for m in
                  layer.modules()}
        owners = {id(m): m for m, _ in self.slots if m is not self.model and id(m) not in inside}
        for module in owners.values():
            self.handles.append(module.register_forward_pre_hook(_Install(self), prepend=True))
            self.handles.append(module.register_forward_hook(_Restore(self), prepend=True, always_call=True))

    def _collect(self):
        """The (module, name) slots of floating params outside kept-fp32 modules, once per registration change."""
        slots = []
        for module in self.model.modules():
            if self.keep_types and isinstance(module, self.keep_types):
                continue
            for name, p in module._parameters.items():
                if p is not None and p.dtype in FLOAT_DTYPES:  # (whatever it holds now: maybe another's copy)
                    slots.append((module, name))
        self.slots[:] = slots
        self.generation = self.watch.generation

    def install(self, called=None):
        """A call of ``called`` (the model, or a module owning cast params) starts: the outermost one swaps."""
        TURN.enter(called)
        self.depth += 1
        if self.depth == 1:
            self._swap_in(called)

    def _swap_in(self, called):
        if self.generation != self.watch.generation:
            self._collect()
        slots = self.slots
        if called is not None and called is not self.model:
            members = {id(m) for m in called.modules()}
            slots = [(m, n) for m, n in slots if id(m) in members]
        copies = {}  # id(param) -> its copy: a tied param is cast once
        touched = set()
        versions = not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled())
        for module, name in slots:
            p = module._parameters.get(name)
            if p is None or p.dtype is self.dtype or p.dtype not in FLOAT_DTYPES:
                continue
            copy = copies.get(id(p))
            if copy is None:
                copy = copies[id(p)] = p.to(self.dtype)
            module._parameters[name] = copy
            self.swapped.append((module, name, p, copy, copy._version if versions else None))
            touched.add(module)
        _refresh_flat_weights(touched)

    def uninstall(self):
        if not TURN.holds():  # (a call whose install raised while waiting its turn)
            return
        self.depth = max(self.depth - 1, 0)
        if not self.depth:
            self._put_back()
        TURN.leave()

    def restore(self):
        """Put back what a call left swapped and give up its turn (deinitialize after an interrupted call)."""
        self._put_back()
        TURN.reset()
        self.depth = 0

    def _put_back(self):
        """Put the fp32 params back (each slot still holding its copy: one the forward replaced is left), with
        any in-place edit the call made to a copy (Embedding's max_norm, a hook clamping weights)."""
        touched, written = set(), set()
        while self.swapped:
            module, name, param, copy, version = self.swapped.pop()
            if module._parameters.get(name) is copy:
                module._parameters[name] = param
            if version is not None and copy._version != version and id(param) not in written:
                written.add(id(param))
                _write_back(param, copy)
            touched.add(module)
        _refresh_flat_weights(touched)

    def remove(self):
        """Remove the hooks and put back any param a call interrupted by a BaseException left swapped."""
        while self.handles:
            self.handles[-1].remove()
            self.handles.pop()
        self.restore()


def _write_back(param, copy):
    """An in-place edit of a compute copy during the call is the model's edit of its weight: the fp32 param takes
    the edited values where the copy no longer holds the param's own rounding; the others stay exact."""
    with torch.no_grad():
        edited = copy.ne(param.to(copy.dtype))
        param.copy_(torch.where(edited, copy.to(param.dtype), param))


def _refresh_flat_weights(modules):
    """RNN modules read their weights from ``_flat_weights``, a list rebuilt from ``_parameters``."""
    for module in modules:
        if isinstance(module, torch.nn.RNNBase):
            module._init_flat_weights()
