"""Whether a model changed since initialize: :class:`RegistrationWatch` (torch's registration hooks, filtered to the
model, and the modules built outside it that may have joined it without a hook)."""
import threading
import weakref

from torch.nn.modules import module as _module_mod

from .._torch.compat import tracing


class RegistrationWatch:
    """Whether one model changed since initialize, counted in ``generation``: the model's input hook re-checks its
    dtypes, and O2's compute copies collect their slots again, only when it moved (each a walk of the model).

    torch's global registration hooks (of modules, parameters and buffers) report every registration in the
    process. One into a module of the model counts at once. One into any other module counts only if that module
    is part of the model at the model's next call (:meth:`settle`): it may have been put there without a hook
    (``ModuleList.insert`` and ``torch.ao.quantization.convert`` write ``_modules`` directly). That module is held
    weakly until then, so the usual ones cost nothing: HF models build ``CrossEntropyLoss()`` inside ``forward`` on
    every call (its ``weight`` buffer is registered), a script may build a loss module per step; both are gone by
    the next call. Put into ``_modules`` directly, a module is not seen if it was built before initialize or before
    an earlier call of the model, or made without a registration (``copy.deepcopy``, ``torch.load``).

    Once the model runs compiled (:meth:`compile_starts`, from its traced hooks; dynamo cannot run :meth:`settle`),
    every registration counts, as one inside a traced forward does: dynamo guards on ``generation`` and retraces.
    Traced code reads only ``compiled``, ``pending`` (booleans) and ``generation``: a list's length would become a
    guard that fails at every step.

    A buffer registered into the model changes no param: it is noted in ``buffers`` for O2's compute copies to give
    it the half dtype at the next call (``notes_buffers``; without them nothing reads it), with no walk (HF's
    rotary embeddings of the ``longrope`` and ``dynamic`` kinds register ``inv_freq`` in their forward).
    """

    MAX_SUSPECTS = 4096  # modules built outside the model between two calls (more: the next call walks the model)

    def __init__(self, model):
        self.model = model
        self.generation = 0
        self.members = None  # ids of the model's modules as of the last walk (None: walk again before use)
        self.suspects = []  # weak references to modules outside the model that got a registration since the last call
        self.pending = False  # suspects is not empty
        self.compiled = False  # the model's hooks were traced by dynamo: every registration counts
        self.notes_buffers = False  # O2's compute copies read ``buffers``
        self.buffers = []  # (module, name): buffers registered into the model since the last call
        self.lock = threading.Lock()
        self.handles = []

    def install(self):
        self.handles.append(_module_mod.register_module_module_registration_hook(self._bump))
        self.handles.append(_module_mod.register_module_parameter_registration_hook(self._bump))
        self.handles.append(_module_mod.register_module_buffer_registration_hook(self._buffer_registered))
        return self

    def remove(self):
        """Remove the hooks (again safe); also one whose handle an interrupt lost between register and append."""
        while self.handles:
            self.handles[-1].remove()
            self.handles.pop()
        for hooks in (_module_mod._global_module_registration_hooks,
                      _module_mod._global_parameter_registration_hooks,
                      _module_mod._global_buffer_registration_hooks):
            for key in [key for key, hook in hooks.items() if hook in (self._bump, self._buffer_registered)]:
                del hooks[key]

    def member_ids(self):
        """The ids of the model's modules (a walk only after a change), or None if another thread changed the model
        during the walk."""
        members = self.members
        if members is None:
            generation = self.generation
            try:
                members = {id(m) for m in self.model.modules()}
            except RuntimeError:  # (another thread registered into the model mid-walk: its change counted)
                return None
            with self.lock:
                if generation == self.generation:
                    self.members = members
        return members

    def _bump(self, module, *args):
        if self.compiled or tracing():
            self.generation += 1
            return
        members = self.member_ids()
        with self.lock:
            if members is None or id(module) in members:
                self._changed()
            else:
                self._suspect(module)

    def _buffer_registered(self, module, name, buffer):
        if self.compiled or tracing():
            self.generation += 1
            return
        members = self.member_ids()
        with self.lock:
            if members is None:
                self._changed()
            elif id(module) not in members:
                self._suspect(module)
            elif self.notes_buffers:
                if len(self.buffers) < self.MAX_SUSPECTS:
                    self.buffers.append((module, name))
                else:  # (the slot collection adopts every buffer)
                    self.buffers = []
                    self._changed()

    def take_buffers(self):
        """The buffers registered into the model since the last call, forgotten here."""
        with self.lock:
            noted, self.buffers = self.buffers, []
        return noted

    def _suspect(self, module):
        self.pending = True
        if len(self.suspects) < self.MAX_SUSPECTS:
            self.suspects.append(weakref.ref(module))
        else:
            self.suspects = [_ALIVE]

    def _changed(self):
        self.generation += 1
        self.members = None

    def settle(self):
        """At a call of the model (before its dtype check and slot collection): a module that got a registration
        outside the model and is still alive may have joined it since; if any did, the model changed."""
        with self.lock:
            suspects, self.suspects, self.pending = self.suspects, [], False
        alive = [module for module in (ref() for ref in suspects) if module is not None]
        if not alive:
            return
        old, self.members = self.members, None
        members = self.member_ids()
        if members is None or old is None or members != old:
            with self.lock:
                self._changed()

    def at_call(self, traced):
        """A call of the model starts (its readers call this before comparing ``generation``): in eager code the
        modules built outside it are checked (:meth:`settle`); in traced code (``traced``) only booleans are read,
        and the first traced call starts the compiled rule (:meth:`compile_starts`)."""
        if traced:
            if not self.compiled:
                self.compile_starts()
        elif self.pending:
            self.settle()

    def compile_starts(self):
        """The model's hooks are traced by dynamo for the first time: from now on every registration counts; the
        modules built outside the model since its last eager call count too (one may have joined it)."""
        self.compiled = True
        if self.pending:
            self.pending = False
            self.generation += 1

    def __getstate__(self):
        return {"model": None, "generation": self.generation, "members": set(), "suspects": [], "buffers": [],
                "compiled": False, "pending": False, "notes_buffers": False, "lock": None, "handles": []}


def _ALIVE():
    """A stand-in suspect that is always alive (too many were noted: the next call walks the model)."""
    return _ALIVE
