"""``apex.amp.lists``: Apex's O1 op lists as mutable Python lists that feed amp_patch's op table.

Scripts such as NVIDIA's Tacotron2 edit them at import time, before ``amp.initialize``::

    amp.lists.functional_overrides.FP32_FUNCS.remove("softmax")
    amp.lists.functional_overrides.FP16_FUNCS.append("softmax")

At each O1 ``amp.initialize`` (and ``amp.init()``) the differences from Apex's original lists become an overlay
on the op list in use (``op_lists=``, default the shipped ``apex`` list): a name removed from a list leaves that
category (with its in-place ``name_`` variant, as Apex derived those from the same lists), a name added joins it
(moving from another category if it was there). A name the target does not have raises an
:class:`~amp_patch.errors.OpListError` that starts with the ``file:line`` of the statement that added it and
names the list. Edits made after ``initialize`` apply at the next call, as in Apex.
"""
from ...config.oplist import load_op_lists
from ...errors import ConfigError, OpListError
from ...patching.resolve import resolve_name, resolve_target
from . import functional_overrides, tensor_overrides, torch_overrides
from ._names import OpNameList, _key

__all__ = ["functional_overrides", "torch_overrides", "tensor_overrides"]  # Apex's names (apex_modules.md)

_CATEGORY = {"FP16_FUNCS": "half", "FP32_FUNCS": "float", "CASTS": "promote", "SEQUENCE_CASTS": "sequence_promote",
             "BANNED_FUNCS": "banned"}
_TARGET = {functional_overrides: "torch.nn.functional", torch_overrides: "torch", tensor_overrides: "torch.Tensor"}


_ORIGINAL = {(module, kind): getattr(module, kind).pristine for module in _TARGET for kind in _CATEGORY
             if hasattr(module, kind)}


def _lists():
    for module, target in _TARGET.items():
        for kind, category in _CATEGORY.items():
            names = getattr(module, kind, None)
            if names is not None:
                yield target, category, _checked(module, kind, names)


def _checked(module, kind, names):
    """The list itself, or (a script replaced it wholesale: ``FP32_FUNCS = [...]``) a copy compared with Apex's."""
    if isinstance(names, OpNameList):
        return names
    qualname = f"apex.amp.lists.{module.__name__.rpartition('.')[2]}.{kind}"
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"{qualname} is a {type(names).__name__}; it must stay a list of op names (edit it "
                          "with append/remove, or assign a list)")
    replaced = OpNameList(qualname, _ORIGINAL[(module, kind)])
    list.clear(replaced)
    list.extend(replaced, names)
    return replaced


def _check_name(target, name, names, where):
    try:
        if not isinstance(name, str):
            raise ConfigError(f"{name!r} is not an op name (a string)")
        resolve_name(target, resolve_target(target), name)
    except ConfigError as exc:
        path, _, line = (where or "<unknown>:?").rpartition(":")
        raise OpListError(path, int(line) if line.isdigit() else None,
                          f"{names.qualname} holds {name!r}, which amp_patch cannot use: {exc}. Fix the name or "
                          "remove it from the list", entry=name) from None


def _edits(base):
    remove, add = {}, {}
    for target, category, names in _lists():
        for item in names.removed():
            for name in (_key(item), _key(item) + "_"):
                entry = base.get(target, name)
                if entry is not None and entry.category == category:
                    remove.setdefault(target, []).append(name)
        for item, where in names.added():
            name = _key(item)
            _check_name(target, name, names, where)
            entry = base.get(target, name)
            if entry is not None and entry.category == category and name not in remove.get(target, ()):
                continue  # already there (amp_patch's list may hold more than Apex's)
            spec = {"name": name, "message": item[1]} if category == "banned" and isinstance(item, tuple) else name
            add.setdefault(category, {}).setdefault(target, []).append(spec)
    return remove, add


def overlay(op_lists=None):
    """``op_lists`` with the edits of ``apex.amp.lists`` applied on top; ``op_lists`` itself when unedited."""
    base_spec = "apex" if op_lists is None else op_lists
    if not any(names.added() or names.removed() for _, _, names in _lists()):
        return op_lists
    remove, add = _edits(load_op_lists(base_spec))
    if not remove and not add:
        return op_lists
    edits = {"description": "apex.amp.lists edits"}
    if remove:
        edits["remove"] = remove
    if add:
        edits["add"] = add
    return (list(base_spec) if isinstance(base_spec, (list, tuple)) else [base_spec]) + [edits]
