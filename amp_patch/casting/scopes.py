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
import dataclasses
import functools
import re
import threading

import torch

CATEGORIES = ("half", "float", "promote", "fp8")
_get_ident = threading.get_ident


@dataclasses.dataclass(frozen=True)
class Scope:
    """One ``scopes:`` key: a glob, its compiled pattern, its entries and where it was declared."""

    glob: str
    entries: tuple  # OpEntry, each with .scope == glob
    path: str
    line: int

    def matches(self, module_path):
        return compile_glob(self.glob).fullmatch(module_path) is not None


@functools.lru_cache(maxsize=1024)
def compile_glob(glob):
    """``*``: one dotted component (or part of one); ``**``: any number of components (also none)."""
    parts = []
    for token in re.split(r"(\*\*\.?|\*)", glob):
        if token.startswith("**"):
            parts.append(r"(?:[^.]+\.)*" if token.endswith(".") else r".*")
        elif token == "*":
            parts.append(r"[^.]*")
        else:
            parts.append(re.escape(token))
    return re.compile("".join(parts))


def parse_scopes(document, block, line):
    """The scopes of one op-list document (``document`` is oplist's ``_Document``: its errors and entry parser)."""
    from ..config._yaml import Map
    if not isinstance(block, Map):
        raise document.error(line, "scopes must map module-path globs to category overrides, e.g. "
                             "'scopes: {\"encoder.*.attn\": {float: {torch: [bmm]}}}'")
    scopes = []
    for glob, overrides in block.items():
        glob_line = block.key_lines[glob] or line
        _check_glob(document, glob, glob_line)
        if not isinstance(overrides, Map) or not overrides:
            raise document.error(glob_line, f"scope {glob!r} must map categories ({', '.join(CATEGORIES)}) to "
                                 "{target: [names]}, e.g. {float: {torch: [bmm]}}", glob)
        entries = {}
        for category, targets in overrides.items():
            if category not in CATEGORIES:
                raise document.error(overrides.key_lines[category] or glob_line, f"scope {glob!r}: category "
                                     f"{category!r} is not allowed in a scope; allowed: {', '.join(CATEGORIES)}",
                                     category)
            for entry in document._parse_block(category, targets, overrides.key_lines[category] or glob_line):
                key = (entry.target, entry.name)
                if key in entries:
                    raise document.error(entry.line, f"scope {glob!r} lists {entry.qualname} twice (as "
                                         f"{entries[key].category} and {entry.category}); keep one", entry.name)
                entries[key] = dataclasses.replace(entry, scope=glob)
        scopes.append(Scope(glob, tuple(entries.values()), document.path, glob_line))
    return scopes


def _check_glob(document, glob, line):
    if not isinstance(glob, str) or not glob or glob.strip() != glob:
        raise document.error(line, f"scope key {glob!r} must be a module path glob such as 'encoder.layers.*.attn' "
                             "(the root module: use the global categories instead)", glob)
    if any(not part for part in glob.split(".")) or re.search(r"[^\w.*\-]", glob):
        raise document.error(line, f"scope key {glob!r} is not a module path glob: use names as "
                             "model.named_modules() spells them, joined by '.', with * (one part) or ** (any)",
                             glob)


def merge_scopes(base, new):
    """``base`` scopes updated by ``new`` ones: a glob declared again replaces/extends the base's entries."""
    merged = {s.glob: s for s in base}
    for scope in new:
        old = merged.get(scope.glob)
        if old is not None:
            entries = {(e.target, e.name): e for e in old.entries}
            entries.update({(e.target, e.name): e for e in scope.entries})
            scope = dataclasses.replace(scope, entries=tuple(entries.values()))
        merged[scope.glob] = scope
    return tuple(merged.values())


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
