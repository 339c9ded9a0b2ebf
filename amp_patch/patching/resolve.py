"""Resolve op-list targets and names to torch objects, and decide what may be patched.

Op lists may only name tensor ops that torch itself defines, inside torch's own
namespaces that are already imported (loading a list never imports a module).
This module answers "is ``torch.nn.functional.linear`` patchable?" with either
the object or a message that says why not. A tensor op is a function torch's
``__torch_function__`` protocol covers (``torch.overrides``), a builtin of one of
torch's C op namespaces, a method of ``torch.Tensor``, or one of torch's Python
functions that hands its arguments to a tensor op of its own name (as
``Tensor.cholesky`` did once ``torch.cholesky`` moved to ``torch._linalg_utils``):
what a function does decides, not the module it lives in. ``torch.save``,
``torch.manual_seed`` and the like are refused; so is a stub that only raises
(an op a newer torch removed: its entry needs ``max_torch``).
"""
import dis
import functools
import re
import sys
import types

import torch

from ..errors import ConfigError
from .patcher import MISSING, find_site

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Tensor dunders that are operators and may be wrapped; every other dunder
# (__init__, __getattribute__, __torch_function__, ...) is off limits.
_OPERATOR_DUNDERS = frozenset(
    f"__{p}{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "div", "mod", "pow", "matmul",
               "and", "or", "xor", "lshift", "rshift")
    for p in ("", "r", "i")
) | frozenset(f"__{op}__" for op in ("eq", "ne", "lt", "le", "gt", "ge", "neg", "pos", "abs", "invert"))

KNOWN_TARGETS = ("torch", "torch.nn.functional", "torch.Tensor", "torch._C._nn", "torch.linalg",
                 "torch.special", "torch.fft", "torch._C._linalg", "torch._C._special", "torch._VF",
                 "torch.nn.modules.rnn._VF")


def _is_torch_name(qualname):
    return isinstance(qualname, str) and (qualname == "torch" or qualname.startswith("torch."))


def resolve_target(target):
    """Return the module or class named ``target`` (a dotted path inside torch).

    Raises ``ConfigError`` with the reason when it is outside torch or not a namespace.
    """
    if not isinstance(target, str) or not all(IDENTIFIER.match(p) for p in target.split(".")):
        raise ConfigError(f"target {target!r} is not a dotted name; use one of {', '.join(KNOWN_TARGETS)}")
    if not _is_torch_name(target):
        raise ConfigError(f"target {target!r} is outside torch's namespaces; only torch and names under "
                          f"torch. may be patched (e.g. {', '.join(KNOWN_TARGETS[:4])})")
    obj = torch
    for i, part in enumerate(target.split(".")[1:], start=2):
        nxt = _getattr(obj, part)
        if nxt is None:
            prefix = ".".join(target.split(".")[:i])
            nxt = sys.modules.get(prefix)
            if nxt is None:
                raise ConfigError(f"target {target!r}: {prefix} does not exist in torch {torch.__version__} or is "
                                  "not imported (loading an op list never imports a module); import it before "
                                  f"loading the list, or use a known target: {', '.join(KNOWN_TARGETS)}")
        obj = nxt
    _check_namespace(target, obj)
    return obj


def _check_namespace(target, obj):
    if isinstance(obj, types.ModuleType):
        owner_name = obj.__name__
    elif isinstance(obj, type):
        owner_name = obj.__module__
    else:
        raise ConfigError(f"target {target!r} is a {type(obj).__name__}, not a module or class")
    if not _is_torch_name(owner_name):
        raise ConfigError(f"target {target!r} resolves to {owner_name!r}, which is outside torch's namespaces")


def _defined_by_torch(obj):
    if _is_torch_name(getattr(obj, "__module__", None)):
        return True
    objclass = getattr(obj, "__objclass__", None)
    return objclass is not None and _is_torch_name(getattr(objclass, "__module__", None))


def lookup(owner, name):
    """The attribute ``name`` of ``owner`` the way a call site sees it, or None (the patcher's lookup)."""
    seen = find_site(owner, name)[1]
    return None if seen is MISSING else seen


@functools.lru_cache(maxsize=1)
def _overridable():
    import torch.overrides

    return frozenset(f for funcs in torch.overrides.get_overridable_functions().values() for f in funcs)


def _op_namespaces():
    c = torch._C
    return tuple(getattr(c, n) for n in ("_VariableFunctions", "_nn", "_linalg", "_special", "_fft", "_nested",
                                          "_sparse") if hasattr(c, n))


def _is_native_tensor_op(obj):
    try:
        if obj in _overridable():
            return True
    except TypeError:  # unhashable
        return False
    if isinstance(getattr(obj, "__objclass__", None), type) and issubclass(obj.__objclass__, torch._C.TensorBase):
        return True
    name = getattr(obj, "__name__", None)
    return isinstance(name, str) and any(getattr(ns, name, None) is obj for ns in _op_namespaces())


def is_tensor_op(obj):
    """True for tensor ops (see the module docstring), False for torch's other callables."""
    if _is_native_tensor_op(obj):
        return True
    return isinstance(obj, types.FunctionType) and any(
        _is_native_tensor_op(called) for called in _same_named_callees(obj))


def _same_named_callees(fn):
    """The objects ``fn``'s code names (``torch.x.y``, globals, ``from m import y``) by its own name."""
    own = fn.__name__.lstrip("_")
    found = []
    for code in _code_objects(fn.__code__):
        current = module = None
        for ins in dis.get_instructions(code):
            if ins.opname == "LOAD_GLOBAL":
                current = fn.__globals__.get(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and current is not None:
                current = _getattr(current, ins.argval)
            elif ins.opname == "IMPORT_NAME":
                current, module = None, _imported(fn, ins.argval)
            elif ins.opname == "IMPORT_FROM" and module is not None:
                current = _getattr(module, ins.argval)
            else:
                current = None
            if current is not None and own in (str(ins.argval).lstrip("_"),
                                               getattr(current, "__name__", "").lstrip("_")):
                found.append(current)
    return found


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _imported(fn, name):
    if name.startswith("."):  # relative to the function's package (torch._tensor -> torch)
        package = fn.__globals__.get("__package__") or ""
        name = package + name if name != "." else package
    return sys.modules.get(name) if _is_torch_name(name) else None


def _removed_stub(obj):
    """A stub that only raises, or a method that only calls one (``Tensor.qr`` on torch 2.14+)."""
    return isinstance(obj, types.FunctionType) and (
        only_raises(obj) or any(only_raises(callee) for callee in _same_named_callees(obj)))


def only_raises(fn):
    """True for a Python function with no way to return: a stub left where torch removed an op."""
    return isinstance(fn, types.FunctionType) and not any(
        ins.opname.startswith("RETURN") or ins.opname == "YIELD_VALUE" for ins in dis.get_instructions(fn.__code__))


def _getattr(obj, name):
    # Some torch namespaces (torch.classes, torch.ops.<ns>) raise RuntimeError, not AttributeError, for unknown names.
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001
        return None


def resolve_name(target, owner, name):
    """Return the callable ``target.name`` or raise ``ConfigError`` saying why it cannot be patched."""
    if not isinstance(name, str) or not IDENTIFIER.match(name):
        raise ConfigError(f"{name!r} is not a valid op name (expected a plain identifier such as 'linear')")
    if name.startswith("__") and name.endswith("__") and name not in _OPERATOR_DUNDERS:
        raise ConfigError(f"{target}.{name} is not an operator dunder and may not be patched; allowed dunders "
                          "are arithmetic/comparison operators such as __add__, __matmul__, __pow__, __eq__")
    obj = lookup(owner, name)
    if obj is None:
        raise ConfigError(f"{target}.{name} does not exist in torch {torch.__version__}; check the spelling, "
                          "or mark the entry 'optional: true' / 'min_torch: X.Y' if it is version-dependent")
    if isinstance(obj, type) or isinstance(obj, types.ModuleType) or not callable(obj):
        raise ConfigError(f"{target}.{name} is a {type(obj).__name__}, not a function; only functions and "
                          "methods may be listed")
    if not _defined_by_torch(obj):
        raise ConfigError(f"{target}.{name} is {obj!r}, which torch does not define; only torch's own "
                          "functions may be listed")
    if not is_tensor_op(obj):
        where = getattr(obj, "__module__", None) or "torch"
        if _removed_stub(obj):
            raise ConfigError(f"{target}.{name} ({where}.{obj.__qualname__}) only raises in torch {torch.__version__}: "
                              "torch removed the op and left a stub; give the entry 'max_torch: \"X.Y\"' (the last "
                              "torch that had it) so it is inactive here, or remove it")
        raise ConfigError(f"{target}.{name} ({where}.{getattr(obj, '__qualname__', name)}) is not a tensor op, so "
                          "casting its arguments would change what it does (e.g. save fp16 checkpoints); list "
                          "tensor ops such as torch.matmul or torch.nn.functional.softmax")
    return obj
