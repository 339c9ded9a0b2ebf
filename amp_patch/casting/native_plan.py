"""Which ops the hybrid engine leaves to native autocast: the op table compared with native's own policy, as data.

Native autocast's policy for a device is shipped as an op list (``torch_cpu``, ``torch_cuda``: every registered
aten op on each Python entry point that reaches it). An entry of the session's table *matches native* when the
reference lists the same ``(target, name)`` with the same category for every device type the fast path turns
on, and nothing about it needs Python: not an in-place Tensor method (native registers no in-place op, the
Python engine casts to ``self``'s dtype), not banned (native raises its own error), not named by a scope or a
``register_*_function``, and the reference entry has no ``note`` (a note marks an entry that reaches its aten op
through an alias or a composite, or that native does not register at all) nor a CUDA ``fp32_set_opt_dtype`` /
``fp32_append_dtype`` marker (native passes ``dtype=`` instead of casting).

Every other entry keeps its Python wrapper, and in a fast region that wrapper runs with native autocast off for
its call (:func:`off_entries` adds wrappers that only do that, for the reference's entries the table lacks and
for entry points that reach a natively cast op through a C++ composite no wrapper sees).
"""
import dataclasses
import functools
import pathlib
import re

from ..config.oplist import OpEntry, load_op_lists

REFERENCE_LISTS = {"cpu": "torch_cpu", "cuda": "torch_cuda"}
_NOT_SAME_MARKERS = re.compile(r"^\s*-\s*(?:name:\s*)?([A-Za-z_0-9]+).*\((fp32_set_opt_dtype|fp32_append_dtype)\)")
# entry points whose C++ composite reaches an aten op native autocast casts, where no wrapper sees it: the Python
# engine runs them uncast (reflection/replication padding inside torch._C._nn.pad, float on CPU; mm/matmul inside
# cov, corrcoef, tensordot, bilinear, matrix_power, multi_dot, chain_matmul, pinv). Found by comparing the two
# engines over every op of torch's op_db (tests/oracle/test_hybrid_engine_matches_python.py, AMP_PATCH_FULL_OPDB=1);
# einsum and inner (bmm/mm inside) and F.bilinear (bound to the builtin at import) by a docs-only adversary
COMPOSITE_GAPS = (("torch._C._nn", "pad"), ("torch", "cov"), ("torch", "corrcoef"), ("torch", "tensordot"),
                  ("torch", "bilinear"), ("torch", "matrix_power"), ("torch", "chain_matmul"),
                  ("torch.Tensor", "cov"), ("torch.Tensor", "corrcoef"), ("torch.Tensor", "matrix_power"),
                  ("torch._C._linalg", "linalg_matrix_power"), ("torch._C._linalg", "linalg_multi_dot"),
                  ("torch._C._linalg", "linalg_pinv"), ("torch.linalg", "matrix_power"), ("torch.linalg", "multi_dot"),
                  ("torch.linalg", "pinv"), ("torch", "einsum"), ("torch", "inner"), ("torch.Tensor", "inner"),
                  ("torch.nn.functional", "bilinear"))


@dataclasses.dataclass(frozen=True)
class Reference:
    """Native autocast's policy for one device type: ``(target, name) -> category``, and the keys to keep Python."""

    categories: dict
    python_only: frozenset


def _shipped_path(name):
    here = pathlib.Path(__file__).resolve().parent.parent
    for folder in (here / "op_lists", here.parent / "op_lists"):
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    raise FileNotFoundError(f"{name}.yaml (the shipped native policy) was not found beside amp_patch")


@functools.lru_cache(maxsize=4)
def reference(device_type):
    """The shipped native policy of ``device_type`` (None when amp_patch ships none for it)."""
    name = REFERENCE_LISTS.get(device_type)
    if name is None:
        return None
    import yaml  # (importing amp_patch reads no YAML)

    table = load_op_lists(name)
    path = _shipped_path(name)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    python_only = set()
    for category in ("half", "float", "promote", "sequence_promote", "banned"):
        for target, items in (raw.get(category) or {}).items():
            for item in items or ():
                if isinstance(item, dict) and item.get("note"):
                    python_only.add((target, item["name"]))
    marked = {m.group(1) for m in map(_NOT_SAME_MARKERS.match, path.read_text(encoding="utf-8").splitlines()) if m}
    python_only.update(key for key in ((e.target, e.name) for e in table.entries) if key[1] in marked)
    return Reference({(e.target, e.name): e.category for e in table.entries}, frozenset(python_only))


def _is_inplace_method(entry):
    from .wrappers import is_inplace_name

    return entry.target == "torch.Tensor" and is_inplace_name(entry.name)


def native_keys(table, device_types, keep_python=frozenset()):
    """The ``(target, name)`` keys of ``table`` native autocast casts the same way on every device type given
    (empty when amp_patch ships no policy for one of them). ``keep_python``: keys scopes or registrations own."""
    refs = [reference(d) for d in device_types]
    if not refs or any(r is None for r in refs):
        return frozenset()
    found = set()
    for entry in table.entries:
        key = (entry.target, entry.name)
        if key in keep_python or entry.category == "banned" or _is_inplace_method(entry):
            continue
        if all(r.categories.get(key) == entry.category and key not in r.python_only for r in refs):
            found.add(key)
    return frozenset(found)


def off_entries(table, device_types, keep_python=frozenset()):
    """Entries for the ops native autocast would cast in a fast region where the Python engine does not: the
    references' entries the table lacks, and :data:`COMPOSITE_GAPS`. Their wrappers only turn native off."""
    keys = set(COMPOSITE_GAPS)
    for device in device_types:
        ref = reference(device)
        if ref is not None:
            keys.update(ref.categories)
    keys = sorted(k for k in keys if k not in table and k not in keep_python)
    return tuple(OpEntry(target, name, "native_off", "<native autocast>", 0) for target, name in keys)


def native_sees(device_types):
    """The keys whose calls native autocast may cast in a fast region (the references' entries and
    :data:`COMPOSITE_GAPS`): a non-matching wrapper of one of these runs with native off there; any other wrapper
    (an apex-list ``add``, a user's registration of an op native never casts) runs as it is, one frame less."""
    keys = set(COMPOSITE_GAPS)
    for device in device_types:
        ref = reference(device)
        keys.update(ref.categories if ref is not None else ())
    return frozenset(keys)
