"""Op-list entries that name one object twice: aliases given different categories, one module under two names.

``torch.conv2d`` and ``torch.nn.functional.conv2d`` are one function: a model attribute bound to it (``self.conv
= F.conv2d``, rerouted through the wrappers) can only run with one of the two categories, so two entries giving it
different categories are refused. ``torch._VF`` and ``torch.nn.modules.rnn._VF`` are one module: two entries
for one name of it are one patch site, refused whatever their categories.
"""
from ..errors import OpListError
from ..patching.patcher import MISSING, find_site
from ..patching.resolve import resolve_target


def check_aliases(entries, path=None):
    """Raise ``OpListError`` for two entries that name one patch site, or one function with two categories
    (``entries``: the table's final entries, in list order). The error points at the entry of the list being
    loaded (``path``) when one of the two comes from an extended base, else at the later one."""
    sites, functions = {}, {}
    for entry in entries:
        owner = resolve_target(entry.target)
        first = sites.setdefault((id(owner), entry.name), entry)
        if first is not entry:
            here, other = _blame(first, entry, path)
            raise OpListError(here.path, here.line, f"{here.qualname} ({here.category}) and {other.qualname} "
                              f"({other.category}, {_where(other)}) are one attribute: {here.target} "
                              f"and {other.target} are one module. Keep one of the two entries", here.name)
        obj = find_site(owner, entry.name)[1]
        if obj is MISSING or not callable(obj):
            continue
        first = functions.setdefault(id(obj), (obj, entry))[1]
        if first is not entry and first.category != entry.category:
            here, other = _blame(first, entry, path)
            raise OpListError(here.path, here.line, f"{here.qualname} ({here.category}) and {other.qualname} "
                              f"({other.category}, {_where(other)}) are one function ({here.qualname} "
                              f"is {other.qualname}): a module attribute bound to it would run with the other "
                              "entry's category. Give both entries one category, or list only one of them",
                              here.name)


def _where(entry):
    """``path:line`` of an entry, ``path:?`` for one without a line (an inline mapping), as OpListError writes it."""
    return f"{entry.path}:{entry.line if entry.line is not None else '?'}"


def _blame(first, later, path):
    """(entry to report at, the other one)."""
    if first.path == path and later.path != path:
        return first, later
    return later, first
