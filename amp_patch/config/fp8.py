"""The op lists' ``fp8`` category: which ops it can hold, the table-level ``fp8_recipe``, and alias moves.

An ``fp8`` entry runs its matmul through ``torch._scaled_mm`` (see :mod:`amp_patch.casting.fp8`). Only ops whose
arguments map onto one 2-D matmul can: ``linear`` (``x @ W.T + b``), ``mm`` and ``matmul`` (its 2-D weight form;
other shapes run in the half dtype). Any other name under ``fp8`` is an error at its line, so nothing listed is
silently run another way.

``fp8_recipe`` is a setting of the whole table: ``tensorwise`` (the default; torchao's default recipe) or
``rowwise`` (torchao's ``rowwise`` recipe). A list that ``extends`` another inherits its recipe; a later layer
(one that extends, or an ``add:``/``remove:`` layer in a sequence) may override it.
"""
import dataclasses

from ..errors import OpListError
from ..patching.patcher import MISSING, find_site
from ..patching.resolve import resolve_target

RECIPES = ("tensorwise", "rowwise")
DEFAULT_RECIPE = "tensorwise"

#: op name -> how the fp8 wrapper reads its arguments (see amp_patch.casting.fp8)
FP8_OPS = {"linear": "linear", "mm": "mm", "matmul": "matmul", "__matmul__": "matmul", "__rmatmul__": "rmatmul"}


def read_recipe(document, inherited):
    """The recipe of ``document`` (an oplist ``_Document``): its own ``fp8_recipe``, else ``inherited``."""
    doc = document.doc
    if "fp8_recipe" not in doc:
        return inherited
    value, line = doc["fp8_recipe"], doc.key_lines["fp8_recipe"]
    if not isinstance(value, str) or value not in RECIPES:
        raise document.error(line, f"fp8_recipe {value!r} is not a recipe; allowed: {', '.join(RECIPES)} "
                             "(tensorwise: one scale per tensor, e4m3 operands and e5m2 gradients; rowwise: one "
                             "power-of-2 scale per row, e4m3 for all three)", value)
    return value


def check_entry(document, entry):
    """Refuse an ``fp8`` entry the fp8 wrapper cannot run as one scaled matmul (at the entry's line)."""
    if entry.category == "fp8" and entry.name not in FP8_OPS:
        raise document.error(entry.line, f"{entry.qualname} cannot be fp8: the fp8 category holds matmuls whose "
                             f"arguments map onto one scaled matmul ({', '.join(FP8_OPS)}); list "
                             f"{entry.name} under half, float or promote instead", entry.name)


def move_aliases(entries, moved, previous_category, listed):
    """After an ``add:`` moved ``moved`` into or out of ``fp8``, move the base's entries naming the same function
    (``torch._C._nn.linear`` for ``torch.nn.functional.linear``) along with it: fp8 is a choice per function, and
    an alias left behind would refuse the list (one function, two categories). ``listed``: the keys the add
    itself names."""
    if "fp8" not in (moved.category, previous_category):
        return
    function = _function(moved)
    if function is None:
        return
    for key, other in list(entries.items()):
        if other is moved or other.category == moved.category or key in listed:
            continue  # an alias this same add lists keeps its own entry (and its own error, if it conflicts)
        if _function(other) is function:
            entries[key] = dataclasses.replace(other, category=moved.category, path=moved.path, line=moved.line,
                                               message=None, strict=False)


def _function(entry):
    try:
        obj = find_site(resolve_target(entry.target), entry.name)[1]
    except (OpListError, ValueError):
        return None
    return None if obj is MISSING or not callable(obj) else obj
