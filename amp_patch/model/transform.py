"""Model-side changes for O0/O2/O3: cast the weights, cast inputs and outputs, keep some modules fp32.

Everything is done with removable hooks and recorded so ``deinitialize`` can
undo it: forward pre-/post-hooks (no replaced ``forward`` attribute), and for
cast models a state_dict post-hook (the model's state_dict holds the fp32
master values, or fp32 copies without masters, under every name of tied params)
and a load_state_dict pre-hook (loading also updates the masters).

The hooks are objects of the classes below, so a model can be pickled (``torch.save(model)``) and copied
(``copy.deepcopy``, as EMA and teacher copies are made) during a session. A copy is independent of the session:
its state_dict hooks become inert (its ``state_dict()`` is its own tensors, in their current dtypes) while its
input/output casts keep following its own weights (see :class:`CastInputs`).
"""
import sys
import threading
import types

import torch

from .._torch.compat import tracing
from .._torch.hooks import (  # noqa: F401 (InertHook: pickles name it here)
    FAST_PATH_TYPES,
    MODULE_CALL_CODE,
    ForwardHook,
    InertHook,
    SessionHook,
    forward_hook,
    forward_pre_hook,
    running,
)
from ..casting.wrappers import cast_tree
from ..config.dtypes import FLOAT_DTYPES, HALF_DTYPES
from ..errors import UsageError
from ..weights.compute_copies import ComputeCopies
from ..weights.layouts import kept_fp32_ids
from ..weights.state_dict import LoadMastersHook, StateDictHook
from ..weights.thread_params import EDITS, ThreadParams
from .attention_masks import MasksLikeQuery, attention_modules
from .registration_watch import RegistrationWatch  # (pickles of models saved during a session name it here)

_BATCHNORM = (torch.nn.modules.batchnorm._BatchNorm,)


class _SparseGradType(type):
    def __instancecheck__(cls, module):
        return isinstance(module, _EMBEDDINGS) and bool(getattr(module, "sparse", False))


_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


class SparseEmbedding(metaclass=_SparseGradType):
    """``isinstance(m, SparseEmbedding)``: an ``Embedding``/``EmbeddingBag`` with ``sparse=True``. O2's compute copies
    keep it fp32 (a keep type): torch cannot carry a sparse grad back through ``weight.to(half)`` (``to()``'s
    backward refuses the layout change), so its weight stays the fp32 param and its output is cast to the half
    dtype, the same values as a lookup in the half-rounded weight."""


def _caster(dtype, fp64=False):
    """Cast floating tensors (fp64 excepted unless dtype is fp64, or ``fp64``: Apex's ``to_type``) to ``dtype``."""

    def cast(t):
        dt = t.dtype
        if dt is dtype or dt not in FLOAT_DTYPES or (dt is torch.float64 and not fp64):
            return t
        return t.to(dtype=dtype)

    return cast


def _cast(t, dtype, fp64):
    """``t`` cast as :func:`_caster`'s function casts it (a call's one input or output, without building one)."""
    dt = t.dtype
    if dt is dtype or dt not in FLOAT_DTYPES or (dt is torch.float64 and not fp64):
        return t
    return t.to(dtype=dtype)


def _cast_once(args, kwargs, dtype, fp64=False):
    """Cast the call's floating tensors, each distinct tensor once: an argument passed several times stays one
    tensor (``MultiheadAttention``'s fused fast path needs ``query is key is value``)."""
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # model(x): the common call
        return (_cast(args[0], dtype, fp64),), kwargs
    cast = _caster(dtype, fp64)
    seen = {}  # id -> (source, cast); holding the source keeps its id unique during the call

    def cast_one(t):
        found = seen.get(id(t))
        if found is None:
            found = seen[id(t)] = (t, cast(t))
        return found[1]

    return cast_tree(args, cast_one), cast_tree(kwargs, cast_one)


class WeightSlots:
    """Where the params amp_patch cast live, as ``(module, name)``: read at each forward, so the weights actually
    used count (``torch.func.functional_call`` puts its tensors in ``module._parameters``; ``.data`` may be
    replaced). The first one gives the model's dtype."""

    def __init__(self):
        self.slots = []
        self.copies = None  # O2's ComputeCopies filling these slots for each call (one-owner layout), if any

    def __getstate__(self):  # (a copy or pickle of the model is not part of the session's calls)
        return {**self.__dict__, "copies": None}

    def dtype(self, default):
        param = self.slots[0][0]._parameters.get(self.slots[0][1]) if self.slots else None
        return default if param is None else param.dtype

    def check(self, model, default, traced=False):
        """The model's dtype (:meth:`dtype`), refusing (naming the fix) a cast param whose dtype is no longer it:
        the forward would fail. Reads each slot as ``module._parameters.get(name)`` does (a
        :class:`~amp_patch.weights.thread_params.ThreadParams` gives this thread's copy), inline: one frame a call.
        Where this thread's call of the model put a copy in every slot and no slot was assigned since, only the
        copies' dtypes are read (``.data`` may have changed one); ``traced``: dynamo is tracing (it reads the slots)."""
        owner = self.copies
        if owner is not None and not traced:
            call = owner.call
            if call.depth and call.edits == EDITS[0] and call.called is model:
                dtype = owner.dtype
                for entry in call.swapped:
                    if entry[4].dtype is not dtype:
                        break
                else:
                    return dtype
        dtype, last, copies = None, None, None
        for module, name in self.slots:  # (~0.2 us a param: 40 us a forward for 200 params on a slow CPU)
            params = module._parameters
            if params is not last:  # (a module's slots are consecutive)
                last = params
                copies = getattr(params._local, "copies", None) if type(params) is ThreadParams else None
            param = copies.get(name) if copies else None
            if param is None:
                param = dict.get(params, name)
            if dtype is None:
                dtype = default if param is None else param.dtype
            if param is not None and param.dtype is not dtype:
                _refuse_mixed(model, module, name, param.dtype, dtype)
        return default if dtype is None else dtype


def _refuse_mixed(model, module, pname, got, dtype):
    path = next((n for n, m in model.named_modules() if m is module), None)
    where = f"{path}.{pname}" if path else pname
    raise UsageError(
        f"parameter {where!r} of the {type(model).__name__} is {got} but the model's weights are {dtype}: its "
        f"value (.data, or a tensor passed to torch.func.functional_call) was given another dtype after "
        f"amp_patch.initialize(). Give it the model's dtype (e.g. model.{where}.data = value.to({dtype})), or pass "
        f"functional_call every weight in one dtype (e.g. {{k: v.to({dtype}) for k, v in state.items()}})")


class CastInputs(ForwardHook):
    """Forward pre-hook of a cast model: floating inputs follow the dtype of its weights (``like``, the
    :class:`WeightSlots` of the params amp_patch cast, read at each forward), so ``model.float()`` after
    initialize, or ``functional_call`` with the fp32 ``state_dict()``, runs in fp32. A module added since
    initialize whose weights have another dtype (a new fp32 head), or a cast param given another dtype, is refused
    at the next forward, naming the fix."""

    def __init__(self, like, dtype, keep_types, watch, fp64=False):
        self.like, self.dtype, self.keep_types, self.watch = like, dtype, keep_types, watch
        self.fp64 = fp64  # the apex alias: float64 inputs are cast too (Apex's to_type)
        self.checked = watch.generation

    def __call__(self, module, args, kwargs=None):
        traced, watch = tracing(), self.watch
        dtype = self.like.check(module, self.dtype, traced)
        if traced or watch.pending:
            watch.at_call(traced)
        if watch.generation != self.checked:
            _check_dtypes(module, dtype, self.keep_types)
            self.checked = self.watch.generation
        fp64 = getattr(self, "fp64", False)
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # model(x): the common call, inline
            cast = (_cast(args[0], dtype, fp64),)
            return cast if kwargs is None else (cast, kwargs)
        if kwargs is None:  # (torch calls a hook removed during this call, by deinitialize, without them)
            return _cast_once(args, {}, dtype, fp64)[0]
        return _cast_once(args, kwargs, dtype, fp64)


def _check_dtypes(model, dtype, keep_types):
    kept = kept_fp32_ids(model, keep_types)
    for name, module in model.named_modules():
        if id(module) in kept:
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dtype in FLOAT_DTYPES and p.dtype is not torch.float64 and p.dtype is not dtype:
                where = f"{name}.{pname}" if name else pname
                raise UsageError(
                    f"parameter {where!r} of the {type(model).__name__} is {p.dtype} but the model amp_patch cast "
                    f"runs in {dtype}: a module added (or replaced) after amp_patch.initialize() keeps its own dtype "
                    f"and would get {dtype} activations. Cast it to the model's dtype (e.g. model.{name or 'x'}"
                    f".to({dtype})) before the forward (and add its params to the optimizer: "
                    f"optimizer.add_param_group), or build it before initialize")


class CastOutputs(ForwardHook):
    """Forward hook (``always_call``): floating outputs to a fixed dtype (``cast_model_outputs``, fp32 by default);
    ``fp64``: float64 outputs too (the apex alias, as Apex's ``to_type``). Only the outermost call of the model in
    a thread casts (its pre-hook :class:`EnterCall` counts): a recursive forward (``self(h, depth - 1)``) feeds the
    inner call's output to the outer call's half weights. The items a generator forward yields are cast."""

    skip = None  # a model passed with one of its outer models: ``skip()`` is true inside the outer's forward

    def __init__(self, dtype, fp64=False):
        self.dtype, self.fp64 = dtype, fp64
        self.depths = {}  # thread ident -> calls of the model in progress
        self.frames = {}  # thread ident -> the frame of torch's outermost call (None: not known)

    def __getstate__(self):  # (a copy of the model is not inside this model's calls)
        return {**self.__dict__, "depths": {}, "frames": {}}

    def __call__(self, module, args, out):
        depths = getattr(self, "depths", None)
        if depths is not None and not tracing():
            ident = threading.get_ident()
            depth = depths.pop(ident, 0)
            frames = self.__dict__.get("frames", {})
            if depth > 1 and (frames.get(ident) is None or sys._getframe(1) is not frames[ident]):
                depths[ident] = depth - 1  # (a recursive call ends; the outermost one ends all)
                return None
            frames.pop(ident, None)
        if self.skip is not None and self.skip():
            return None  # (session/nested_models.py: the outer model's own output cast applies)
        if type(out) is torch.Tensor:  # (the usual output)
            return _cast(out, self.dtype, getattr(self, "fp64", False))
        cast = _caster(self.dtype, getattr(self, "fp64", False))
        if isinstance(out, types.GeneratorType):
            return _cast_items(out, cast)
        return cast_tree(out, cast)


def _cast_items(generator, cast):
    try:
        while True:
            try:
                item = next(generator)
            except StopIteration as stop:
                return stop.value
            yield cast_tree(item, cast)
    finally:
        generator.close()


class EnterCall(ForwardHook):
    """Forward pre-hook of a model whose outputs are cast: a call starts, counted in its :class:`CastOutputs`. One
    found in progress whose frame is gone was cut off (Ctrl-C skips the always-called hooks): this call is the
    outermost."""

    def __init__(self, outputs):
        self.outputs = outputs

    def __call__(self, module, args):
        if tracing():
            return
        outputs = self.outputs
        depths, ident = outputs.depths, threading.get_ident()
        frames = outputs.__dict__.setdefault("frames", {})
        depth = depths.get(ident, 0)
        if depth and frames.get(ident) is not None and not running(frames[ident]):
            depth = 0
        if not depth:
            frame = sys._getframe(1)  # (module_call_frame(0))
            frames[ident] = frame if frame.f_code is MODULE_CALL_CODE else None
        depths[ident] = depth + 1


class CastArgsTo(ForwardHook):
    """Forward pre-hook (with kwargs) of a module kept fp32: its inputs to fp32."""

    def __call__(self, module, args, kwargs):
        to_fp32 = _caster(torch.float32, fp64=True)  # (float64 activations too: the module's weights are fp32)
        return cast_tree(args, to_fp32), cast_tree(kwargs, to_fp32)


class CastOutputsLike(ForwardHook):
    """Forward hook of a module kept fp32: its outputs back to the model's dtype (that of ``like``)."""

    def __init__(self, like, dtype):
        self.like, self.dtype = like, dtype

    def __call__(self, module, args, out):
        return cast_tree(out, _caster(self.like.dtype(self.dtype)))


class ModelPatch:
    """The changes made to one model; ``restore`` undoes them."""

    def __init__(self, model):
        self.model = model
        self.handles = []
        self.original_dtypes = {}
        self.buffers = []
        self.kept = {}  # id(tensor) -> its pre-initialize data, until commit(): a failed initialize restores it
        self.like = WeightSlots()  # where the params cast live: the first gives the model's dtype, as it is now
        self.output_casts = []  # its CastOutputs hooks (session/nested_models.py)

    def cast(self, dtype, keep_types, params=True):
        """Cast params/buffers to ``dtype`` except modules of ``keep_types`` (which stay as they are);
        ``params=False`` (O2's compute copies, see ``compute_copies``): the buffers only.

        Returns ``{id(param): fp32 data}`` for params that changed dtype (zero-copy: the old storage).
        """
        old_data, kept = {}, kept_fp32_ids(self.model, keep_types)
        for module in self.model.modules():
            if id(module) in kept:
                continue
            named = list(module.named_parameters(recurse=False)) if params else []
            for name, t in named + list(module.named_buffers(recurse=False)):
                if t is None or not t.is_floating_point() or t.dtype is dtype or id(t) in self.kept:
                    continue
                self.kept[id(t)] = t.data
                if isinstance(t, torch.nn.Parameter):
                    self.original_dtypes.setdefault(id(t), (t, t.dtype))
                    old_data[id(t)] = t.data
                    self.like.slots.append((module, name))
                else:  # .data keeps the buffer object: restore gives the same tensor back
                    self.buffers.append((module, name, t, t.dtype))
                t.data = t.data.to(dtype)
        return old_data

    def _adopt_buffer(self, module, name, buffer, dtype):
        """A float buffer registered after initialize is cast as initialize cast the others (and restored). One
        registered into a slot held before replaces that slot's entry: a forward registering a new tensor on every
        call keeps one."""
        if id(buffer) not in self.kept:
            self._forget_slot(module, name)
            self.kept[id(buffer)] = buffer.data
            self.buffers.append((module, name, buffer, buffer.dtype))
        buffer.data = buffer.data.to(dtype)

    def _forget_slot(self, module, name):
        for i, (held_by, held_name, old, _) in enumerate(self.buffers):
            if held_by is module and held_name == name:
                self.kept.pop(id(old), None)
                del self.buffers[i]
                return

    def commit(self):
        """initialize succeeded: stop holding the params' pre-initialize data (the masters hold what O2 needs).
        Buffers keep theirs (they are small): one the session never changed gets its exact fp32 value back."""
        buffer_ids = {id(buffer) for _, _, buffer, _ in self.buffers}
        self.kept = {k: v for k, v in self.kept.items() if k in buffer_ids}

    def cast_outputs(self, output_dtype, fp64=False):
        """Cast the model's floating outputs to ``output_dtype`` (O1's ``cast_model_outputs``) at its outermost
        call in a thread."""
        outputs = CastOutputs(output_dtype, fp64)
        self.output_casts.append(outputs)
        if isinstance(self.model, FAST_PATH_TYPES):
            self.handles.append(forward_pre_hook(self.model, EnterCall(outputs)))
        else:
            self.handles.append(self.model.register_forward_pre_hook(EnterCall(outputs), prepend=True))
        self.handles.append(forward_hook(self.model, outputs, always_call=True))

    def cast_io(self, input_dtype, output_dtype, keep_types, compute_copies=False, fp64=False):
        """Cast floating inputs of the model to its weights' dtype and its outputs to ``output_dtype``.
        ``compute_copies``: the one-owner layout's half weights per call (:class:`ComputeCopies`, installed first:
        the input cast follows the weights the forward uses). ``fp64``: float64 inputs and outputs are cast too
        (the apex alias, as Apex's ``to_type``)."""
        watch = RegistrationWatch(self.model)
        self.handles.append(watch)  # before it installs: restore() removes it whenever an interrupt lands
        watch.install()
        if compute_copies:
            copies = ComputeCopies(self.model, input_dtype, keep_types, watch, self.like.slots)
            self.like.copies = copies
            copies.adopt = lambda module, name, buffer: self._adopt_buffer(module, name, buffer, input_dtype)
            watch.notes_buffers = True
            self.handles.append(copies)
            copies.attach()
        self.handles.append(forward_pre_hook(self.model, CastInputs(self.like, input_dtype, keep_types, watch, fp64),
                                             with_kwargs=True))
        self.cast_outputs(output_dtype, fp64)
        if input_dtype in HALF_DTYPES:
            self._keep_modules_fp32(keep_types, input_dtype)
            for attention in attention_modules(self.model, keep_types):
                self.handles.append(attention.register_forward_pre_hook(MasksLikeQuery(), with_kwargs=True))

    def _keep_modules_fp32(self, keep_types, half):
        """User-named fp32 modules (not batchnorm, which takes half input natively) run on fp32 input."""
        extra = tuple(t for t in keep_types if not issubclass(t, _BATCHNORM))
        if not extra:
            return
        kept = [m for m in self.model.modules() if isinstance(m, extra)]
        inner = {id(m) for module in kept for m in module.modules() if m is not module}
        for module in kept:
            if id(module) not in inner:  # (the outermost: the modules inside it run on its fp32 activations)
                self.handles.append(module.register_forward_pre_hook(CastArgsTo(), with_kwargs=True))
                self.handles.append(module.register_forward_hook(CastOutputsLike(self.like, half)))

    def link_state_dict(self, masters, to_model=None):
        """state_dict() holds what amp_patch cast in its original dtype under every name (tied params included):
        the fp32 masters where there are (O2), else an upcast copy (O3, as Apex's state_dict hook did).
        load_state_dict() also writes the masters (in place, so tied params stay tied); ``to_model(param,
        master)``, if given, is the half value the model param then gets (else torch's cast of the loaded one)."""
        if not self.original_dtypes and not self.buffers:
            return
        for module, own in self._restored_per_module(masters):  # (a submodule's own load also reaches the
            self.handles.append(module.register_state_dict_post_hook(StateDictHook(own, to_model)))  # masters)
            self.handles.append(module.register_load_state_dict_pre_hook(LoadMastersHook(own, to_model)))

    def _restored_per_module(self, masters):
        """``(module, its own entries)`` for every module holding something amp_patch cast: each module's
        state_dict hook restores only its own params and buffers, so a submodule's ``state_dict()`` holds fp32
        too (as Apex's ``O2StateDictHook`` on every module) and the model's converts each entry once."""
        buffers = {}
        for module, name, _, dtype in self.buffers:
            buffers.setdefault(id(module), []).append((name, dtype, None, None))
        for module in self.model.modules():
            own = [(name, self.original_dtypes[id(p)][1], masters.get(id(p)), p)
                   for name, p in module._parameters.items() if p is not None and id(p) in self.original_dtypes]
            own += buffers.get(id(module), [])
            if own:
                yield module, own

    def restore(self, masters=None):
        """Remove the hooks and give params/buffers back their dtypes (params get the master values; after a
        failed initialize, params and buffers get their very pre-initialize data back)."""
        while self.handles:  # removed, then forgotten (an interrupt between the two loses no hook)
            self.handles[-1].remove()
            self.handles.pop()
        masters = {**(masters or {}), **self.kept}
        for pid, (param, dtype) in self.original_dtypes.items():
            master = masters.get(pid)
            param.data = master.data if master is not None else param.data.to(dtype)
            if param.grad is not None and param.grad.dtype is not dtype:
                param.grad = None  # a half grad belongs to the half model (and may still be scaled)
        for module, name, buffer, dtype in reversed(self.buffers):
            current = module._buffers.get(name)
            if current is buffer:
                old = self.kept.get(id(buffer))
                unchanged = old is not None and torch.equal(buffer.data, old.to(buffer.dtype))
                buffer.data = old if unchanged else buffer.data.to(dtype)
            elif current is not None:  # the model replaced the buffer while initialized
                module._buffers[name] = current.to(dtype)
        self.original_dtypes.clear()
        self.buffers.clear()
        self.kept = {}

