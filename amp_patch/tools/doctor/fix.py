"""From culprits to the smallest op-list change that removes the bad values, and the op list that holds it."""
import dataclasses
import os

from ...errors import AmpPatchError
from .locate import replay

_MAX_ROUNDS = 8


@dataclasses.dataclass(frozen=True)
class Fix:
    """Run ``target.name`` in float32: inside modules matching ``scope`` (a module path) or, with None, everywhere."""

    target: str
    name: str
    scope: str = None

    def describe(self):
        where = f"in scope {self.scope!r}" if self.scope else "globally"
        return f"{self.target}.{self.name} -> float {where}"


def op_list_spec(base, fixes):
    """The op list (a mapping in the op-list schema) that ``extends`` ``base`` with ``fixes``."""
    spec = {"extends": base}
    scopes, global_ops = {}, {}
    for fix in fixes:
        if fix.scope:
            scopes.setdefault(fix.scope, {}).setdefault("float", {}).setdefault(fix.target, []).append(fix.name)
        else:
            global_ops.setdefault(fix.target, []).append(fix.name)
    if global_ops:
        spec["add"] = {"float": global_ops}
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
        culprit = last.culprits[0]
        found.append(culprit)
        fix = _next_candidate(culprit, tried)
        if fix is None:
            break
        tried.add(fix)
        log.append(f"try {fix.describe()} (culprit {culprit.qualname} in {culprit.module or 'the model'!r})")
        trial = _replay(job, failure, half_dtype, base, fixes + [fix])
        if trial is None:
            log.append(f"  {fix.describe()} does not load as an op-list entry; skipped")
            continue
        fixes.append(fix)
        narrow[fix] = Fix(culprit.target, culprit.name, culprit.module or None)
        last = trial
    if last is None or not last.clean:
        return fixes, found, first, last
    return _minimize(job, failure, half_dtype, base, fixes, log, narrow), found, first, last


def _generalize(path):
    """``blocks.3.attn`` -> ``blocks.*.attn``: the same module in every layer of a ModuleList/Sequential."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _next_candidate(culprit, tried):
    """The culprit's innermost module in every layer, then that module alone, then everywhere."""
    path = culprit.module or None
    candidates = [Fix(culprit.target, culprit.name, _generalize(path)), Fix(culprit.target, culprit.name, path)] \
        if path else []
    for fix in candidates + [Fix(culprit.target, culprit.name)]:
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
        lines += ["add:", "  float:"]
        lines += [f"    {target}: [{', '.join(names)}]" for target, names in spec["add"]["float"].items()]
    if "scopes" in spec:
        lines.append("scopes:")
        for glob, overrides in spec["scopes"].items():
            lines += [f"  {_quote(glob)}:", "    float:"]
            lines += [f"      {target}: [{', '.join(names)}]" for target, names in overrides["float"].items()]
    return "\n".join(lines) + "\n"


def _quote(text):
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def base_for_file(base, out):
    """``base`` as the written file's ``extends:`` (a path is made relative to the file's folder)."""
    if os.sep in str(base) or "/" in str(base) or str(base).endswith((".yaml", ".yml")):
        return os.path.relpath(os.path.abspath(base), os.path.dirname(os.path.abspath(out)))
    return base
