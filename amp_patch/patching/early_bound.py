"""Early-bound references: functions captured before ``initialize`` bypass the patches.

``self.act = F.gelu`` stored on a module at construction (HF transformers'
GELUActivation does this) holds the *original* function. ``reroute`` swaps
such instance attributes for the wrapper of the same entry (undone exactly by
the returned callable); ``scan_globals`` finds module-level ``from torch...
import name`` bindings in the modules that define the models' classes, which
amp_patch reports but does not touch.
"""
import logging
import sys

log = logging.getLogger("amp_patch")
_SKIP = frozenset(("_parameters", "_buffers", "_modules", "training"))


def _wrappers_by_original(engine):
    """id(original) -> (original, wrapper) for every installed function patch."""
    found = {}
    for patch in engine.patcher.patches:
        found.setdefault(id(patch.original), (patch.original, patch.replacement))
    return found


def reroute(models, engine):
    """Point module attributes that hold an original at its wrapper; returns (undo, rerouted names)."""
    originals = _wrappers_by_original(engine)
    changed = []
    for model in models:
        for path, module in model.named_modules():
            for name, value in list(vars(module).items()):
                if name in _SKIP or id(value) not in originals or originals[id(value)][0] is not value:
                    continue
                vars(module)[name] = originals[id(value)][1]
                changed.append((module, name, value, f"{path or type(model).__name__}.{name}"))

    def undo():
        for module, name, value, _ in reversed(changed):
            vars(module)[name] = value

    if changed:
        log.info("routed %d early-bound function reference(s) through its wrappers: %s", len(changed),
                 ", ".join(label for *_, label in changed))
    return undo, [label for *_, label in changed]


def scan_globals(models, engine):
    """Module-level names in the models' defining modules that are bound to an unpatched original."""
    originals = _wrappers_by_original(engine)
    seen, found = set(), []
    for model in models:
        for module in model.modules():
            mod_name = type(module).__module__
            if mod_name in seen or mod_name.startswith("torch"):
                continue
            seen.add(mod_name)
            namespace = vars(sys.modules[mod_name]) if mod_name in sys.modules else {}
            for name, value in namespace.items():
                if id(value) in originals and originals[id(value)][0] is value and not isinstance(value, type):
                    found.append(f"{mod_name}.{name}")
    if found:
        log.warning("cannot reach %d function(s) bound at import time (`from torch... import name`): "
                    "%s. Calls through these names skip O1 casting; call them through their namespace "
                    "(e.g. F.gelu) or wrap them with amp_patch.float_function/half_function.", len(found),
                    ", ".join(found))
    return found

