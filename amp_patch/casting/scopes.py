"""Module-scoped op lists: the ``scopes:`` section of an op list and how it applies at run time.

``scopes:`` maps module-path globs (paths as ``model.named_modules()`` spells them) to category overrides::

    scopes:
      "encoder.layers.*.attn":
        float: {torch: [bmm]}

Inside a module matching a glob (and everything it calls), the listed ops use the scope's category. For each
op the innermost running scoped module that lists it decides; ops a scope does not list fall through to the
enclosing scope, then to the global list. ``*`` matches one path component, ``**`` any number of them.

Run time: only ops named by some scope get a dispatching wrapper, and only modules matching some glob get
an instance ``forward`` (removed again by ``deinitialize``). It pushes/pops the scope's override table on a
per-thread stack held in a dict keyed by thread ident, which is empty while no scoped module runs anywhere: a
scoped op called outside every scoped module pays one truth test of that empty dict; an op no scope names pays
nothing.
"""
import threading

import torch

_get_ident = threading.get_ident


def matching_modules(scopes, model):
    """(module path, module, [scopes matching it, in declaration order]) for every module some glob matches."""
    found = []
    for path, module in model.named_modules():
        if not path:
            continue
        hits = [s for s in scopes if s.matches(path)]
        if hits:
            found.append((path, module, hits))
    return found


def unmatched_globs(scopes, models):
    """Globs that match no module of ``models`` (a typo, or a path that changed)."""
    paths = [p for m in models for p, _ in m.named_modules() if p]
    return [s for s in scopes if not any(s.matches(p) for p in paths)]


class ScopeRuntime:
    """Per-session scope state: override tables, the per-thread scope stacks and the modules it routes."""

    def __init__(self, scopes):
        self.scopes = tuple(scopes)
        self.active = {}  # thread ident -> [(override table, decided-by label), ...]; empty: no scope running
        self.tables = {}  # glob -> {(target, name): wrapper}
        self._undo = []
        self._module_tables = []  # (the table a routed module pushes, the scopes that matched it)
        self._merged = {}

    def scoped_keys(self):
        return {(e.target, e.name) for s in self.scopes for e in s.entries}

    def set_wrapper(self, scope, entry, wrapper):
        self.tables.setdefault(scope.glob, {})[(entry.target, entry.name)] = wrapper

    def attach(self, models):
        """Route every module some glob matches through a scope-pushing forward (later globs override
        earlier ones for one module)."""
        for model in models:
            for _path, module, hits in matching_modules(self.scopes, model):
                table = {}
                self._module_tables.append((table, hits))
                self._undo.append(self._wrap_forward(module, table))
        self.refresh()

    def refresh(self):
        """Point the routed modules' tables at the current wrappers (after an install or a retrace)."""
        for table, hits in self._module_tables:
            table.clear()
            for scope in hits:
                table.update(self.tables.get(scope.glob, {}))
        self._merged.clear()

    def detach(self):
        while self._undo:
            self._undo.pop()()
        self._module_tables.clear()

    def _wrap_forward(self, module, table):
        """An instance ``forward`` that pushes ``table`` for the call; returns the undo."""
        own = vars(module)
        had, previous = "forward" in own, own.get("forward")
        installed = own["forward"] = _ScopedForward(module, previous, self._pusher(table), self._pop)

        def undo():
            if own.get("forward") is installed:
                if had:
                    own["forward"] = previous
                else:
                    del own["forward"]

        return undo

    def _pusher(self, table):
        active, merged = self.active, self._merged

        def push():
            ident = _get_ident()
            stack = active.get(ident)
            if stack is None:
                active[ident] = [table]
                return
            parent = stack[-1]
            key = (id(parent), id(table))
            both = merged.get(key)
            if both is None:
                both = merged[key] = {**parent, **table}
            stack.append(both)

        return push

    def _pop(self):
        ident = _get_ident()
        stack = self.active.get(ident)
        if stack:
            stack.pop()
            if not stack:
                del self.active[ident]

    def dispatcher(self, key, base, original):
        """The installed wrapper of a scoped op: the innermost scope's wrapper, else ``base``."""
        active = self.active

        def scoped(*args, **kwargs):
            if active:
                stack = active.get(_get_ident())
                if stack:
                    alt = stack[-1].get(key)
                    if alt is not None:
                        return alt(*args, **kwargs)
            return base(*args, **kwargs)

        scoped.__wrapped__ = original
        scoped._amp_patch_entry = getattr(base, "_amp_patch_entry", None)
        scoped.__name__ = getattr(original, "__name__", "scoped")
        scoped.__doc__ = getattr(original, "__doc__", None)
        return scoped


def passthrough(original):
    """The global behaviour of an op that only scopes name: call the original."""
    return original


class _ScopedForward:
    """A scoped module's instance ``forward``: push the scope, run the module's own forward, pop.

    It holds the module (not a bound method), so a ``copy.deepcopy`` of the model (an EMA copy) runs the copy's
    own forward, in the same scope. torch.compile does not trace it (``torch.compiler.disable``): dynamo
    resolves torch functions by name, past the patches, so a scoped module runs eagerly (one graph break per
    call) and its ops take the scope's categories; the rest of the model compiles as before.
    """

    def __init__(self, module, previous, push, pop):
        self.module, self.previous, self.push, self.pop = module, previous, push, pop

    def __call__(self, *args, **kwargs):
        return _run_scoped(self, args, kwargs)


@torch.compiler.disable
def _run_scoped(scoped, args, kwargs):
    forward = scoped.previous if scoped.previous is not None else type(scoped.module).forward.__get__(scoped.module)
    scoped.push()
    try:
        return forward(*args, **kwargs)
    finally:
        scoped.pop()
