"""Cast trace: which patched entry points ran, in which dtypes, with how many casts and cache hits.

``with amp_patch.trace() as t:`` (:mod:`amp_patch.session.tracing`) reinstalls the O1 wrappers in a recording
variant for the body and the plain ones on exit; the plain wrappers contain no
tracing code, so tracing off costs nothing. Optionally it attributes calls to
the module that was running and counts torch calls on half tensors that no op
list entry covers (through a TorchFunctionMode active only while tracing).
"""
import collections
import contextlib
import json

import torch
from torch.overrides import TorchFunctionMode

from ..casting.cache import make_to_half
from ..casting.wrappers import iter_tensors, make_wrapper
from ..config.dtypes import HALF_DTYPES

_FIELDS = ("qualname", "category", "source", "scope", "module", "calls", "input_dtypes", "output_dtypes", "casts",
           "cache_hits", "cache_misses")


class Row:
    """Counters for one (entry point, module) pair."""

    def __init__(self, entry, module):
        self.entry, self.module = entry, module
        self.calls = self.casts = self.cache_hits = self.cache_misses = 0
        self.input_dtypes = collections.Counter()
        self.output_dtypes = collections.Counter()

    def as_dict(self):
        e = self.entry
        return {"qualname": e.qualname, "category": e.category, "source": f"{e.path}:{e.line}",
                "scope": e.scope or "(global)", "module": self.module, "calls": self.calls,
                "input_dtypes": _fmt(self.input_dtypes), "output_dtypes": _fmt(self.output_dtypes),
                "casts": self.casts, "cache_hits": self.cache_hits, "cache_misses": self.cache_misses}


def _fmt(counter):
    return sorted(",".join(str(d).replace("torch.", "") for d in key) or "-" for key in counter)


def _dtypes(tree):
    return [t.dtype for t in iter_tensors(tree)]


class _TracedContext:
    """What a recording wrapper casts with: the engine's switch and a to_half that counts cache hits."""

    def __init__(self, engine, tracer):
        self.disabled, self.allow_banned = engine.disabled, engine.allow_banned
        base = make_to_half(engine.half_dtype, engine.cache, engine.disabled)
        entries = engine.cache.entries

        def to_half(t):
            before = entries.get(id(t))
            out = base(t)
            row = tracer.current
            if row is not None and t.dtype is torch.float32 and t.requires_grad and isinstance(t, torch.nn.Parameter):
                if before is not None and before[3] is out:
                    row.cache_hits += 1
                else:
                    row.cache_misses += 1
            return out

        self.to_half = to_half


class Tracer:
    """Collects rows while installed; ``report()`` / ``to_markdown()`` / ``to_json()`` read them."""

    def __init__(self, modules=True, unpatched=True):
        self.rows = {}
        self.unpatched = collections.Counter()
        self.current = None
        self.last_entry = None
        self.module_stack = []
        self.track_modules, self.track_unpatched = modules, unpatched
        self._contexts = {}

    def _row(self, entry):
        module = self.module_stack[-1] if self.module_stack else None
        key = (entry.qualname, module, entry.scope)  # scope: which scopes: glob decided the call (None: global)
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = Row(entry, module)
        return row

    def wrap(self, original, entry, engine, *, method=False):
        """The recording wrapper of ``entry``: the plain wrapper around a recording original."""
        ctx = self._contexts.get(id(engine)) or self._contexts.setdefault(id(engine), _TracedContext(engine, self))
        seen = []

        def reached(*args, **kwargs):
            seen.append(_dtypes((args, kwargs)))
            return original(*args, **kwargs)

        inner = make_wrapper(reached, entry, ctx, method=method)

        def traced(*args, **kwargs):
            if engine.in_step():  # the optimizer's own math, with casting paused: nothing to cast, not listed
                return inner(*args, **kwargs)
            row, outer = self._row(entry), self.current
            row.calls += 1
            given = _dtypes((args, kwargs))
            row.input_dtypes[tuple(given)] += 1
            self.current, hits, depth = row, row.cache_hits, len(seen)
            try:
                out = inner(*args, **kwargs)
            finally:
                self.current = outer
            if len(seen) > depth:
                changed = sum(a is not b for a, b in zip(given, seen.pop()))
                row.casts += max(changed - (row.cache_hits - hits), 0)
            row.output_dtypes[tuple(_dtypes(out))] += 1
            self.last_entry = entry
            return out

        traced.__wrapped__ = original
        traced._amp_patch_entry = entry
        return traced

    def report(self):
        return sorted((row.as_dict() for row in self.rows.values()),
                      key=lambda r: (r["module"] or "", r["qualname"]))

    def unpatched_report(self):
        return [{"qualname": name, "calls_on_half": n} for name, n in sorted(self.unpatched.items())]

    def to_json(self):
        return json.dumps({"rows": self.report(), "unpatched_on_half": self.unpatched_report()}, indent=2)

    def to_markdown(self):
        lines = ["| " + " | ".join(_FIELDS) + " |", "|" + "---|" * len(_FIELDS)]
        for row in self.report():
            lines.append("| " + " | ".join(_cell(row[f]) for f in _FIELDS) + " |")
        if self.unpatched:
            lines += ["", "| not patched, called on half tensors | calls |", "|---|---|"]
            lines += [f"| {r['qualname']} | {r['calls_on_half']} |" for r in self.unpatched_report()]
        return "\n".join(lines)


def _cell(value):
    if isinstance(value, list):
        return "; ".join(value)
    return "" if value is None else str(value)


class UnpatchedCalls(TorchFunctionMode):
    """Counts torch calls whose tensor args include a half tensor and that no wrapper covers."""

    def __init__(self, tracer, originals):
        super().__init__()
        self.tracer, self.originals = tracer, originals

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "_amp_patch_entry", None) is not None:
            # a Python-level torch function re-dispatching through its (patched) global name while we are
            # already inside its wrapper: run the original, do not count or cast twice
            return func.__wrapped__(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":  # tensor property reads (x.shape, x.T, ...)
            return func(*args, **kwargs)
        if id(func) not in self.originals and self.tracer.current is None:
            if any(d in HALF_DTYPES for d in _dtypes((args, kwargs))):
                self.tracer.unpatched[_qualname(func)] += 1
        return func(*args, **kwargs)


def _qualname(func):
    name = getattr(func, "__name__", repr(func))
    if getattr(func, "__objclass__", None) is not None:
        return f"torch.Tensor.{name}"
    return f"{getattr(func, '__module__', None) or 'torch'}.{name}"


@contextlib.contextmanager
def running_modules(names, stack):
    """While the body runs, ``stack`` holds the names of the modules whose forward is running (innermost last).

    ``names`` maps ``id(module)`` to its name; a module missing from it is named by its class. Used by
    :func:`trace` and by the precision doctor's replay.
    """
    def enter(module, args):
        stack.append(names.get(id(module), type(module).__name__))

    def leave(module, args, out):
        if stack:
            stack.pop()

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
