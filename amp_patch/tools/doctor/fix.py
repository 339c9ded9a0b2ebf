"""From culprits to the smallest op-list change that removes the bad values, and the op list that holds it."""
import dataclasses
import os

from ...errors import AmpPatchError
from ...patching.resolve import resolve_target
from .locate import replay

_MAX_ROUNDS = 8


@dataclasses.dataclass(frozen=True)
class Fix:
    """Run ``target.name`` in ``category`` (float32; ``half`` takes an fp8 op out of float8): inside modules
    matching ``scope`` (a module path) or, with None, everywhere."""

    target: str
    name: str
    scope: str = None
    category: str = "float"

    def describe(self):
        where = f"in scope {self.scope!r}" if self.scope else "globally"
        return f"{self.target}.{self.name} -> {self.category} {where}"

    def as_row(self):
        """The report's row (``category`` only where it is not float)."""
        row = dataclasses.asdict(self)
        if self.category == "float":
            del row["category"]
        return row


def op_list_spec(base, fixes):
    """The op list (a mapping in the op-list schema) that ``extends`` ``base`` with ``fixes``."""
    spec = {"extends": base}
    scopes, global_ops = {}, {}
    for fix in fixes:
        if fix.scope:
            scopes.setdefault(fix.scope, {}).setdefault(fix.category, {}).setdefault(fix.target, []).append(fix.name)
        else:
            global_ops.setdefault(fix.category, {}).setdefault(fix.target, []).append(fix.name)
    if global_ops:
        spec["add"] = global_ops
    if scopes:
        spec["scopes"] = scopes
    return spec


def search(job, failure, *, half_dtype, base, log):
    """Add float32 candidates (innermost scope first, then global) until the failing batch replays clean,
    then drop every candidate the replay does not need. Returns (fixes, culprits met, first replay, last replay)."""
    fixes, tried, found, narrow = [], set(), [], {}
    first = last = _replay(job, failure, half_dtype, base, fixes)
    for _ in range(_MAX_ROUNDS):
        if last is None or last.clean or not last.culprits:
            break
        culprit = _as_fixed(last.culprits[0], fixes)
        found.append(culprit)
        fix = _next_candidate(culprit, tried)
        if fix is None:
            break
        tried.add(fix)
        log.append(f"try {fix.describe()} (culprit {culprit.qualname} in {culprit.module or 'the model'!r})")
        kept = [f for f in fixes if (f.target, f.name, f.scope) != (fix.target, fix.name, fix.scope)]
        trial = _replay(job, failure, half_dtype, base, kept + [fix])
        if trial is None:
            log.append(f"  {fix.describe()} does not load as an op-list entry; skipped")
            continue
        fixes[:] = kept + [fix]  # a later category for the same op and scope replaces the earlier one
        narrow[fix] = Fix(culprit.target, culprit.name, culprit.module or None, fix.category)
        last = trial
    if last is None or not last.clean:
        return fixes, found, first, last
    return _minimize(job, failure, half_dtype, base, fixes, log, narrow), found, first, last


def _as_fixed(culprit, fixes):
    """``culprit`` named as the fix already made for its function (``torch._C._nn.linear`` is
    ``torch.nn.functional.linear``: a replay names one function by either), in that fix's category."""
    function, path = _function(culprit.target, culprit.name), culprit.module or None
    for fix in reversed(fixes):
        covers = fix.scope is None or path is not None and fix.scope in (path, _generalize(path))
        if function is not None and covers and _function(fix.target, fix.name) is function:
            return dataclasses.replace(culprit, target=fix.target, name=fix.name, category=fix.category)
    return culprit


def _function(target, name):
    try:
        return getattr(resolve_target(target), name, None)
    except AmpPatchError:
        return None


def _generalize(path):
    """``blocks.3.attn`` -> ``blocks.*.attn``: the same module in every layer of a ModuleList/Sequential."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _next_candidate(culprit, tried):
    """The culprit's innermost module in every layer, then that module alone, then everywhere; an fp8 culprit
    tries these in half first (out of float8, the smallest step), then in float32."""
    path = culprit.module or None
    categories = ("half", "float") if culprit.category == "fp8" else ("float",)
    for category in categories:
        candidates = [Fix(culprit.target, culprit.name, _generalize(path), category),
                      Fix(culprit.target, culprit.name, path, category)] if path else []
        for fix in candidates + [Fix(culprit.target, culprit.name, None, category)]:
            if fix not in tried:
                return fix
    return None


def _minimize(job, failure, half_dtype, base, fixes, log, narrow):
    """Drop each change the replay does not need; narrow a layer glob to the modules that need it."""
    kept = list(fixes)
    for fix in reversed(fixes):
        trial = [f for f in kept if f != fix]
        result = _replay(job, failure, half_dtype, base, trial)
        if result is not None and result.clean:
            log.append(f"  not needed: {fix.describe()}")
            kept = trial
            continue
        exact = narrow.get(fix)
        if exact is not None and exact != fix and exact not in kept:
            trial = [exact if f == fix else f for f in kept]
            result = _replay(job, failure, half_dtype, base, trial)
            if result is not None and result.clean:
                log.append(f"  narrowed: {fix.describe()} -> {exact.describe()}")
                kept = trial
    return kept


def _replay(job, failure, half_dtype, base, fixes):
    try:
        return replay(job, failure.state, failure.batch, half_dtype=half_dtype, op_lists=op_list_spec(base, fixes),
                      intended=failure.intended)
    except AmpPatchError:  # the candidate does not load as an op-list entry (e.g. an op no target holds)
        return None


def yaml_text(base, fixes, header):
    """The op list as YAML (``extends`` the base; ``scopes`` for module fixes; ``add`` for global ones)."""
    spec = op_list_spec(base, fixes)
    lines = [f"# {line}" for line in header] + [f"extends: {_quote(spec['extends'])}"]
    if "add" in spec:
        lines.append("add:")
        for category, targets in spec["add"].items():
            lines.append(f"  {category}:")
            lines += [f"    {target}: [{', '.join(names)}]" for target, names in targets.items()]
    if "scopes" in spec:
        lines.append("scopes:")
        for glob, overrides in spec["scopes"].items():
            lines.append(f"  {_quote(glob)}:")
            for category, targets in overrides.items():
                lines.append(f"    {category}:")
                lines += [f"      {target}: [{', '.join(names)}]" for target, names in targets.items()]
    return "\n".join(lines) + "\n"


def _quote(text):
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def base_for_file(base, out):
    """``base`` as the written file's ``extends:`` (a path is made relative to the file's folder)."""
    if os.sep in str(base) or "/" in str(base) or str(base).endswith((".yaml", ".yml")):
        return os.path.relpath(os.path.abspath(base), os.path.dirname(os.path.abspath(out)))
    return base
