"""Exactly reversible attribute patches: every process-wide patch amp_patch installs goes through a Patcher.

Sites are resolved and patches applied with wrapt (``wrapt.resolve_path``: on a class the value is the first one
in the MRO whose ``__dict__`` holds the name, no descriptor bound; ``wrapt.apply_patch``). We always install on the
*target* (so ``torch.Tensor.softmax`` shadows the inherited ``torch._C.TensorBase.softmax``) and remember whether
the name was the target's own attribute: undoing an inherited one means ``delattr``, undoing an own one means
putting the exact original object back (a staticmethod stays the same staticmethod object). Patches are undone in
reverse order of installation; one that someone else re-patched since is left in place (and logged), so a foreign
wrapper stacked on ours keeps working and ours stays reachable beneath it.

The undo is ours rather than ``wrapt.unwrap_object``'s: that one learns the slot it created from wrapt's proxies,
and the O1 op replacements must stay plain closures (wrapt's proxies forward ``__eq__``/``__hash__``, so dynamo's
table of torch functions takes a ``FunctionWrapper`` for the op itself and never traces it: under
``torch.compile`` the cast would be silently lost).
"""
import dataclasses
import logging

import wrapt

from ..errors import PatchError
from . import registry

log = logging.getLogger("amp_patch")
MISSING = object()


@dataclasses.dataclass
class Patch:
    """One installed patch: ``target.name`` was ``raw`` (own) or inherited, now ``replacement``."""

    target: object
    name: str
    raw: object
    own: bool
    original: object
    replacement: object


def find_site(target, name):
    """The one patch-site lookup (op-list validation uses it too): ``(raw, seen)``.

    ``raw`` is ``target.__dict__[name]`` or ``MISSING``; ``seen`` is what a caller of ``target.name`` gets: on a
    class the first ``__dict__`` in the MRO that holds the name (no descriptor is bound), on a module its
    attribute, ``MISSING`` if none (also when the namespace raises for unknown names, as ``torch.ops`` does, and
    for a class attribute no ``__dict__`` in the MRO holds, such as a metaclass's: that is no patch site).
    """
    raw = vars(target).get(name, MISSING)
    try:
        seen = wrapt.resolve_path(target, name)[2]
    except Exception:  # noqa: BLE001 - wrapt's PathResolutionError; torch.classes / torch.ops raise RuntimeError
        return raw, MISSING
    if isinstance(target, type) and not any(name in vars(klass) for klass in target.__mro__):
        return raw, MISSING
    return raw, seen


class Patcher:
    """An ordered set of patches that can be undone exactly, in reverse order."""

    def __init__(self):
        self._patches = []
        self._sites = set()

    def __len__(self):
        return len(self._patches)

    @property
    def patches(self):
        return tuple(self._patches)

    def sites(self):
        """The patched sites, oldest first, as ``"module.attribute"`` names."""
        return [f"{qualname(patch.target)}.{patch.name}" for patch in self._patches]

    def install(self, target, name, make_replacement):
        """Replace ``target.name`` by ``make_replacement(original)``; returns the replacement."""
        site = (id(target), name)
        if site in self._sites:
            raise PatchError(f"{qualname(target)}.{name} is already patched by this session")
        raw, original = find_site(target, name)
        if original is MISSING:
            raise PatchError(f"{qualname(target)}.{name} does not exist; nothing to patch")
        return self._apply(Patch(target, name, raw, raw is not MISSING, original, make_replacement(original)))

    def add(self, target, name, value):
        """Give ``target`` an attribute ``name`` it does not have (own or inherited); undone by deleting it."""
        if (id(target), name) in self._sites or find_site(target, name)[1] is not MISSING:
            raise PatchError(f"{qualname(target)}.{name} already exists; nothing to add")
        return self._apply(Patch(target, name, MISSING, False, MISSING, value))

    def _apply(self, patch):
        self._patches.append(patch)
        self._sites.add((id(patch.target), patch.name))  # recorded first: an interrupt right after setattr
        registry.register(self)  # leaves nothing unrecorded
        try:
            wrapt.apply_patch(patch.target, patch.name, patch.replacement)
        except BaseException:
            self.restore_all()
            raise
        return patch.replacement

    def restore_all(self):
        """Undo every patch, newest first. Returns the number restored.

        A patch is forgotten only once restored: when restoring one raises (or is interrupted), the others are
        still restored, the failed ones are kept for a later call, and the first error is re-raised."""
        count, failures, kept, first = 0, [], [], None
        while self._patches:
            patch = self._patches[-1]
            try:
                restored = self._restore(patch)
            except BaseException as exc:  # noqa: B036 - re-raised below, after the other patches
                kept.append(patch)
                first = first if first is not None else exc
            else:
                self._sites.discard((id(patch.target), patch.name))
                if not restored:
                    failures.append(f"{qualname(patch.target)}.{patch.name}")
                count += 1
            self._patches.pop()
        self._patches = kept[::-1]
        if not self._patches:
            registry.forget(self)
        if first is not None:
            raise first
        if failures:
            log.warning("left %d attribute(s) as someone else re-patched them after amp_patch: %s",
                        len(failures), ", ".join(failures))
        return count

    @staticmethod
    def _restore(patch):
        current = vars(patch.target).get(patch.name, MISSING)
        if current is (patch.raw if patch.own else MISSING):
            return True  # already as it was (an interrupted earlier restore, or install interrupted before setattr)
        if current is not patch.replacement:
            return False
        if patch.own:
            setattr(patch.target, patch.name, patch.raw)
        else:
            delattr(patch.target, patch.name)
        return True


def qualname(target):
    """``module.Class`` for a class, the module's name for a module."""
    if isinstance(target, type):
        return f"{target.__module__}.{target.__qualname__}"
    return getattr(target, "__name__", repr(target))
