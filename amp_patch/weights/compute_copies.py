"""O2's weights have one owner: the model's registered fp32 parameters. Half weights are compute copies.

For each outermost call of a model amp_patch cast (O2, ``master_weights=True``), :class:`ComputeCopies` makes a
half copy of every cast parameter, ``param.to(half)``, a non-leaf of the fp32 parameter: autograd carries its
grad back into ``param.grad`` in fp32, so grads accumulate in fp32 on the parameter itself. A parameter used
under several names (tied weights) is cast once per call. This is the layout of FSDP2's ``MixedPrecisionPolicy``.

**The copies are the state of one call in one thread.** They live in that thread's overlay of the modules'
``_parameters`` (:mod:`.thread_params`) from the call's start until it returns *or raises*: other threads read
the fp32 params meanwhile (a training thread clipping ``model.parameters()`` beside a background evaluation), and
several threads may call the model at once, each on its own copies. Code of the call that runs outside its
extent re-enters it: a checkpointed segment recomputed during backward (:mod:`.recompute_copies`, reentrant or
not, whatever the segment reads), each resumption of a generator a forward returned. A module owning cast params
called on its own (a submodule, a checkpointed layer, a ``TransformerEncoderLayer``: its hooks are torch's global
ones, filtered to it, so it keeps its fused kernel) makes copies of its own params for its call.

Between calls the model holds only its fp32 parameters: every optimizer (closures, wrappers that step an inner
optimizer), EMA copy, ``load_state_dict`` (of the model or of a submodule), ``clip_grad_norm_(model.parameters())``,
in-place edit and ``deepcopy`` sees the one value there is; nothing is kept in step by hooks.

Params of modules kept fp32 (``keep_batchnorm_fp32``, ``keep_fp32_modules``) are not copied. Modules added after
initialize get copies from their next call on (the registration watch, :mod:`amp_patch.model.registration_watch`,
says when to collect the slots again; the buffers it noted are adopted alone). An RNN's ``_flat_weights`` are
rebuilt around the swap. An in-place edit of a copy during the call (``nn.Embedding``'s
``max_norm``, a forward pre-hook clamping weights; also under ``torch.inference_mode``, whose copies are made as
normal tensors to keep their version counters) is written back into the fp32 param when the call ends (edits
through ``.data`` bypass the version counter and stay on the copy: edit the params between steps). The slots are
shared with :class:`~.transform.WeightSlots`, so the input cast follows the weights the forward uses (a deepcopy
of the model, whose hooks are inert, runs in fp32 on fp32 inputs).
"""
import logging
import threading
import time
import types

import torch
from torch.nn.modules import module as _module_mod

from .._torch import quiet_hooks
from .._torch.compat import tracing
from .._torch.hooks import FAST_PATH_TYPES, running
from ..config.dtypes import FLOAT_DTYPES, HALF_DTYPES
from ..errors import UsageError
from . import reentry, thread_params
from .call_hooks import GlobalHook, Install, Restore, ThreadCall, TracedCall
from .layouts import kept_fp32_ids
from .write_back import renorms, write_back

#: How long ``remove`` (deinitialize) waits for calls other threads started just before it to end, polling.
DRAIN_S, POLL_S = 60.0, 0.0005
_compiling = tracing
_RNN = torch.nn.RNNBase
_FP32 = torch.float32
LIVE = []  # the attached ComputeCopies (recompute_copies re-enters their calls)
_ANY = object()  # uninstall(): whichever module started the call
log = logging.getLogger("amp_patch")


class ComputeCopies:
    """Per model: half compute copies of its fp32 params for each outermost call (see the module docstring).
    ``slots`` is the :class:`~.transform.WeightSlots` list of ``(module, name)`` it fills."""

    def __init__(self, model, dtype, keep_types, watch, slots):
        self.model, self.dtype, self.keep_types, self.watch = model, dtype, keep_types, watch
        self.slots = slots
        self.dtypes = {}  # id(param) -> its dtype when the slots were collected (a param's .data keeps it: O2)
        self.generation = None
        self.call = ThreadCall()
        self.traced = TracedCall()
        self.calls = {}  # thread ident -> depth of its call in progress
        self.live = False
        self.overlaid = {}  # id(module) -> module given a ThreadParams
        self.members = set()  # ids of the model's modules (conversion_guard)
        self.adopt = None  # adopt(module, name, buffer): a float buffer registered after initialize gets cast
        self.kept_ids = set()  # ids of the modules kept fp32 (their params and buffers are left as they are)
        self.handles = []
        self.quieted = []  # inner owners given quiet hook dicts (quiet_hooks)
        self.restore_id = None  # the id of the model's own Restore hook

    def attach(self):
        self._collect()
        self.live = True
        LIVE.append(self)
        if isinstance(self.model, FAST_PATH_TYPES):
            self._hook_fast_path([self.model])
            return self
        self.handles.append(self.model.register_forward_pre_hook(Install(self), prepend=True))
        self.handles.append(self.model.register_forward_hook(Restore(self), prepend=True, always_call=True))
        self.restore_id = self.handles[-1].id
        self._hook_owners()
        return self

    def _hook_fast_path(self, layers):
        """Hooks for fast-path layers, on torch's global lists (in registration order: before the input cast)."""
        if not layers:
            return
        by_id = {id(layer): layer for layer in layers}
        self.handles.append(_module_mod.register_module_forward_pre_hook(GlobalHook(by_id, Install(self))))
        self.handles.append(_module_mod.register_module_forward_hook(GlobalHook(by_id, Restore(self)),
                                                                     always_call=True))

    def _hook_owners(self):
        """The modules that own cast params get the same hooks: called on their own (a submodule called
        directly, a checkpointed layer) they copy their own params; inside an outer call they only count the
        depth. A fast-path layer (``TransformerEncoderLayer``) gets them for every param inside it, on torch's
        global hook lists (its own hooks would cost it the fused kernel); the modules inside it get none."""
        layers = [m for m in self.model.modules() if isinstance(m, FAST_PATH_TYPES) and m is not self.model]
        inside = {id(m) for layer in layers for m in layer.modules()}
        owners = {id(m): m for m, _ in self.slots if m is not self.model and id(m) not in inside}
        for module in owners.values():
            quiet = quiet_hooks.quieten(module, self)
            pre = module.register_forward_pre_hook(Install(self), prepend=True)
            post = module.register_forward_hook(Restore(self), prepend=True, always_call=True)
            self.handles += (pre, post)
            if quiet is not None:
                self.quieted.append(module)
                for hooks, handle in zip(quiet, (pre, post)):  # (quieten's order: pre-hooks, hooks)
                    hooks.own.update((pre.id, post.id))
                    hooks.mine = handle.id
        self._hook_fast_path([layer for layer in layers if not any(
            layer is not other and any(m is layer for m in other.modules()) for other in layers)])

    def _collect(self):
        """The (module, name) slots of floating params outside kept-fp32 modules, once per registration change;
        their modules get a :class:`~.thread_params.ThreadParams`."""
        slots, kept = [], kept_fp32_ids(self.model, self.keep_types)
        self.kept_ids = kept
        for module in self.model.modules():
            if id(module) in kept:
                continue
            for name, p in dict.items(module._parameters):
                if p is not None and p.dtype in FLOAT_DTYPES:
                    slots.append((module, name))
        self.slots[:] = slots
        self.dtypes = {id(p): p.dtype for p in (dict.get(m._parameters, n) for m, n in slots) if p is not None}
        if not tracing():
            self.members = {id(m) for m in self.model.modules()}
            for module, _ in slots:
                if thread_params.install(module, self):
                    self.overlaid[id(module)] = module
            self._adopt_buffers()
        self.generation = self.watch.generation

    def _adopt_buffers(self):
        """Float buffers registered since initialize (``spectral_norm`` applied later) get what initialize gave
        the others: the half dtype (kept-fp32 modules keep theirs)."""
        if self.adopt is None:
            return
        for module in self.model.modules():
            if id(module) in self.kept_ids:
                continue
            for name, buffer in module._buffers.items():
                if _adoptable(buffer, self.dtype):
                    self.adopt(module, name, buffer)

    def _adopt_noted(self):
        """Only the buffers registered into the model since the last call (the registration watch noted them; a
        rotary embedding re-registering ``inv_freq`` in its forward), as :meth:`_adopt_buffers` would."""
        noted = self.watch.take_buffers()
        if self.adopt is None:
            return
        for module, name in noted:
            if id(module) in self.members and id(module) not in self.kept_ids:
                buffer = module._buffers.get(name)
                if _adoptable(buffer, self.dtype):
                    self.adopt(module, name, buffer)

    def _state(self):
        return self.traced if _compiling() else self.call

    def in_call(self):
        """The module whose call (in this thread) holds copies now, or None. Outside dynamo that includes a compiled
        call whose eager part runs now (the code past a graph break, a checkpoint's first run there): the copies its
        traced hooks put in place are that call's."""
        state = self._state()
        if not state.depth and state is self.call:
            state = self.traced
        return state.called if state.depth else None

    def install(self, called=None, frame=None):
        """A call of ``called`` (the model, or a module owning cast params) starts: the outermost one copies.
        Inside a call only the module that started it counts its calls (a recursive forward); the others' hooks do
        nothing, so a pair of hooks that third-party code split (``fuse_modules`` moves a module's pre-hooks, not
        its hooks, to the fused module) cannot leave a call open. ``frame``: torch's call running the hook (None:
        unknown), the outermost call's, recorded before anything else (an interrupt later in this call leaves a
        call the next one finds cut off)."""
        if not self.live:  # (a call that saw the hooks before deinitialize removed them)
            return
        state = self._state()
        if state.depth and called is not state.called:
            return
        if not state.depth and state is self.call:
            state.frame = frame
        state.depth += 1
        if state.depth == 1:
            if state is self.call:
                self.count_call(1)
            state.called = called
            self._swap_in(state, called)

    def start_call(self, called, frame):
        """Eager: this thread's outermost call of ``called`` starts (``frame``: torch's call running it, or None);
        :meth:`install`'s case once its tests passed (:class:`~.call_hooks.Install` runs it on every outermost call).
        The frame first, as in :meth:`install`."""
        call = self.call
        call.frame = frame
        call.depth = 1
        self.calls[threading.get_ident()] = 1  # (count_call(1))
        call.called = called
        self._swap_in(call, called)

    def _swap_in(self, state, called):
        watch, traced = self.watch, state is self.traced
        if traced or watch.pending:
            watch.at_call(traced)
        if self.generation != watch.generation:
            self._collect()
        if not traced and watch.buffers:
            self._adopt_noted()
        slots = self.slots
        if called is not None and called is not self.model:
            members = {id(m) for m in called.modules()}
            slots = [(m, n) for m, n in slots if id(m) in members]
        if state is self.traced:
            return self._swap_traced(state, slots)
        copies = {}  # id(param) -> its copy: a tied param is cast once
        touched, kept = set(), False
        inference, dtype, swapped = torch.is_inference_mode_enabled(), self.dtype, state.swapped
        last, overlay = None, None  # (a module's slots are consecutive: its overlay is looked up once)
        for module, name in slots:
            params = module._parameters
            p = dict.get(params, name)
            if p is None:
                continue
            p_dtype = p.dtype
            if p_dtype is not _FP32 and p_dtype in HALF_DTYPES and self.dtypes.get(id(p), p_dtype) not in HALF_DTYPES:
                self._refuse_master_dtype(module, name, p_dtype)  # (its .data given a half dtype: no fp32 weight left)
            if p_dtype is dtype or p_dtype not in FLOAT_DTYPES:  # (a slot keeping its own tensor: the weight check
                kept = True                                        # reads it)
                continue
            copy = copies.get(id(p))
            if copy is None:
                copy = copies[id(p)] = _cast(p, dtype) if inference else p.to(dtype)
            if params is not last:
                last, overlay = params, None
                if type(params) is thread_params.ThreadParams:  # (its overlay(), inline)
                    local = params._local
                    overlay = getattr(local, "copies", None)
                    if overlay is None:
                        overlay = local.copies = {}
            swapped.append((module, params, name, p, copy, copy._version))  # (first: an interrupt leaves none
            if overlay is not None:                                          # that _put_back does not know)
                overlay[name] = copy
            else:  # (a module added since the last collect, not yet overlaid: collected again next call)
                params[name] = copy
            if isinstance(module, _RNN):  # (its _flat_weights follow the swap)
                touched.add(module)
        state.edits = None if kept or called is not self.model else thread_params.EDITS[0]
        if touched:
            thread_params.refresh_flat_weights(touched)

    def _refuse_master_dtype(self, module, name, got):
        """A param of the model (the fp32 weight the optimizer steps: O2 keeps no other copy) was given a half dtype
        through ``.data``: it would train in half, silently."""
        path = next((n for n, m in self.model.named_modules() if m is module), "")
        where = f"{path}.{name}" if path else name
        want = self.dtypes[id(dict.get(module._parameters, name))]
        raise UsageError(
            f"parameter {where!r} of the {type(self.model).__name__} is {got} but O2 keeps it {want}: it is the "
            f"weight the optimizer steps (each forward computes on a half copy), and its value (.data) was given "
            f"a half dtype after amp_patch.initialize(). Give it back {want} (model.{where}.data = "
            f"value.to({want})); to run a forward on half tensors of your own, pass them to "
            "torch.func.functional_call")

    def _swap_traced(self, state, slots):
        """Under dynamo: the copies go into the shared dicts (the compiled call is one thread's call)."""
        copies = {}
        for module, name in slots:
            params = module._parameters
            p = dict.get(params, name)
            if p is None or p.dtype is self.dtype or p.dtype not in FLOAT_DTYPES:
                continue
            copy = copies.get(id(p))
            if copy is None:
                copy = copies[id(p)] = p.to(self.dtype)
            state.swapped.append((module, params, name, p, copy, None))
            dict.__setitem__(params, name, copy)
        thread_params.refresh_flat_weights({m for m, _ in slots})

    def uninstall(self, output=None, called=_ANY):
        """A call of ``called`` ends (``_ANY``: the call in progress): the outermost one drops its copies. A generator
        it returned re-enters the call, on the same copies, for each of its resumptions (its body runs after the
        call returned)."""
        state = self._state()
        if not state.depth:  # (a call whose install found the hooks removed)
            return None
        if called is not _ANY and called is not state.called:
            return None
        state.depth -= 1
        if state.depth:
            return None
        return self.end_call(state, output)

    def end_call(self, state, output=None):
        """The outermost call whose ``state`` is at depth 0 now ends: its copies go (:meth:`uninstall`'s case once
        its tests passed; :class:`~.call_hooks.Restore` runs it on every outermost call). A generator it returned
        re-enters the call, on the same copies, at each resumption."""
        if state is self.call:
            self.calls.pop(threading.get_ident(), None)  # (count_call(0))
            state.frame = None
        if type(output) is types.GeneratorType and state is self.call:
            called, kept = state.called, list(state.swapped)
            self._put_back(state)
            return reentry.resumed_in_call(self, called, kept, output)
        self._put_back(state)
        return None

    def cut_off(self):
        """Whether this thread's call in progress no longer runs (Ctrl-C skips torch's always-called hooks)."""
        call = self.call
        return bool(call.depth) and call.frame is not None and not _compiling() and not running(call.frame)

    def drop_stale(self):
        """This thread's call was cut off (a ``KeyboardInterrupt`` skips torch's always-called hooks): its copies
        go, so the call starting now, the optimizer and a ``state_dict()`` see the fp32 params again."""
        log.warning("amp_patch: a call of the O2 %s in this thread never ended (interrupted?); its half compute copies "
                    "are dropped", type(self.model).__name__)
        self._put_back(self.call)
        self.call.depth, self.call.frame = 0, None
        self.count_call(0)

    def ensure_restore(self, module):
        """``module`` starts a call: it must have the hook that ends it. Third-party code that moves hooks
        (``fuse_modules`` gives the fused module the first module's pre-hooks, not its hooks) may have left it
        without; it gets one (registered during its pre-hooks, it runs at the end of this very call)."""
        if isinstance(module, FAST_PATH_TYPES):  # (its hooks are torch's global ones)
            return
        always = module._forward_hooks_always_called
        for hook_id, hook in module._forward_hooks.items():
            if type(hook) is Restore and hook.owner is self and hook_id in always:
                return
        self.handles.append(module.register_forward_hook(Restore(self), prepend=True, always_call=True))

    def count_call(self, depth):
        """Note whether this thread is in a call (``depth`` 0 or 1: the outermost call starts or ends; deinitialize
        waits for and refuses around other threads' calls). One dict write, atomic under the GIL: no lock, which
        an interrupt (Ctrl-C) landing as a ``with lock:`` acquires could leave held for every later call."""
        if depth:
            self.calls[threading.get_ident()] = depth
        else:
            self.calls.pop(threading.get_ident(), None)

    def resume(self, called, kept):
        """Context manager: a generator's resumption runs in its call again, on the call's copies ``kept``."""
        return reentry.Resumed(self, called, kept)

    def reenter(self, called, frame=None):
        """Context manager: run code of a call of ``called`` that runs outside its extent (a checkpointed
        segment's recomputation) with this thread's copies, unless a call is in progress here already.
        ``frame``: the frame running the re-entered code (an interrupt that cuts it off, even inside the context
        manager's ``__enter__``, which then has no ``__exit__``, leaves a call the next one drops)."""
        return reentry.Reentered(self, called, frame)

    def restore(self):
        """Put back what a call of this thread left and forget it (deinitialize after an interrupted call)."""
        self._put_back(self.call)
        self._put_back(self.traced)
        self.call.depth = self.traced.depth = 0
        self.call.frame = None
        self.calls.pop(threading.get_ident(), None)

    def _put_back(self, state):
        """Drop this thread's copies (a slot the forward re-assigned keeps what it was given), writing back into
        the fp32 param any in-place edit the call made to a copy (Embedding's max_norm, a hook clamping weights)."""
        touched, written, swapped = set(), set(), state.swapped
        own, last, overlay = state is self.call, None, None
        while swapped:
            module, params, name, param, copy, version = swapped.pop()
            if own and type(params) is thread_params.ThreadParams:
                if params is not last:  # (a module's slots are consecutive: its overlay is looked up once)
                    last, overlay = params, getattr(params._local, "copies", None)  # (overlay(), inline)
                if overlay is not None and overlay.get(name) is copy:
                    del overlay[name]
            elif dict.get(params, name) is copy:
                dict.__setitem__(params, name, param)
            edited = copy._version != version if version is not None else renorms(module)
            if edited and id(param) not in written:
                written.add(id(param))
                write_back(param, copy)
            if isinstance(module, _RNN):
                touched.add(module)
        state.called = None
        if touched:
            thread_params.refresh_flat_weights(touched)

    def busy_threads(self):
        """Idents of the threads with a call of the model in progress (``list()`` copies the dict in one step)."""
        return [ident for ident, depth in list(self.calls.items()) if depth]

    def remove(self):
        """Remove the hooks, wait for calls other threads started before (their copies must outlive them), put
        back what a call of this thread left, give the modules plain ``_parameters`` again."""
        self.live = False
        if self in LIVE:
            LIVE.remove(self)
        while self.handles:
            self.handles[-1].remove()
            self.handles.pop()
        while self.quieted:
            quiet_hooks.restore(self.quieted.pop())
        self._drain()
        self.restore()
        for module in self.overlaid.values():
            thread_params.uninstall(module)
        self.overlaid.clear()

    def _drain(self):
        me, deadline = threading.get_ident(), time.monotonic() + DRAIN_S
        while any(ident != me for ident in self.busy_threads()):
            alive = {t.ident for t in threading.enumerate()}
            for ident in [i for i in list(self.calls) if i not in alive]:  # (a thread that died inside a call
                self.calls.pop(ident, None)                                # will not end it)
            if time.monotonic() > deadline:
                raise UsageError(f"deinitialize(): the call of the {type(self.model).__name__} that thread(s) "
                                 f"{self.busy_threads()} started did not end in {DRAIN_S:.0f} s. Stop the "
                                 "threads that call the model (join them) before amp_patch.deinitialize()")
            time.sleep(POLL_S)


def check_no_calls_elsewhere():
    """deinitialize() from one thread while another thread's call of an O2 model is in progress would take its
    copies away mid-forward: refused, naming the fix. (A call that starts after this check finds the hooks inert
    and runs in fp32; one that started just before is waited for by :meth:`ComputeCopies.remove`.)"""
    me, alive = threading.get_ident(), {t.ident: t for t in threading.enumerate()}
    for copies in list(LIVE):
        for ident in copies.busy_threads():
            if ident != me and ident in alive:
                raise UsageError(
                    f"amp_patch.deinitialize() from thread {threading.current_thread().name!r} while thread "
                    f"{alive[ident].name!r} is inside a call of the O2 {type(copies.model).__name__}: its half "
                    "compute copies would go away mid-forward. Stop the threads that call the model (join "
                    "them) first, then deinitialize()")


def _adoptable(buffer, dtype):
    return (buffer is not None and buffer.dtype in FLOAT_DTYPES and buffer.dtype is not dtype
            and buffer.dtype is not torch.float64)


def _cast(param, dtype):
    """A compute copy under inference_mode: a normal tensor (an inference tensor has no version counter, and an
    in-place edit, Embedding's max_norm, must still be written back)."""
    with torch.inference_mode(False), torch.no_grad():
        return param.to(dtype)
