"""The opt-in ``apex`` import alias: ``import apex.amp`` / ``from apex import amp`` get amp_patch.

:func:`install_apex_alias` puts one :class:`ApexAliasFinder` first on
``sys.meta_path``. Without a real ``apex`` installed the finder provides a stub
``apex`` package: ``apex.amp`` is amp_patch's; ``apex.X`` (and deeper names) are
served from amp_patch's mirror of Apex's tree (:mod:`amp_patch.legacy.mirror`)
where amp_patch has one, and raise an :class:`~amp_patch.legacy.unsupported.ApexImportError`
naming the alternative where it has not. The top-level ``amp_C`` / ``apex_C`` come
from the mirror too, unless real ones are installed. With a real ``apex`` the finder
provides ``apex.amp`` and the mirrored ``apex.X`` that apex lacks, and leaves the rest
to apex; if that apex has its own ``apex.amp`` the alias refuses unless ``force=True``.
While installed, ``importlib.metadata`` knows an ``apex`` distribution (amp_patch's
version) unless a real one is installed (:mod:`amp_patch.legacy.metadata`).
:meth:`AliasHandle.uninstall` (or :func:`uninstall_apex_alias`) restores
``sys.meta_path`` and every ``apex``/``amp_C``/``apex_C`` entry of ``sys.modules`` as they were.
"""
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import types

from ..errors import UsageError
from . import apex_amp, metadata
from .amp_state import maybe_print
from .mirror import MIRROR_ROOT, TOP_LEVEL, has_mirror, is_alias_name, is_amp_name, mirror_name, mirror_spec
from .unsupported import attribute_error, import_error, missing_name_error

log = logging.getLogger("amp_patch")
_MARK = "__amp_patch_alias__"
_STATE = {"handle": None}
MISSING = object()


def _ours(module):
    return getattr(module, "__dict__", {}).get(_MARK, False)


class _AmpLoader(importlib.abc.Loader):
    """Creates ``apex.amp``: a package holding amp_patch's Apex surface (and ``apex.amp._amp_state``, as Apex had)."""

    def exec_module(self, module):
        for name in apex_amp.__all__ + apex_amp._EXTRA:
            setattr(module, name, getattr(apex_amp, name))
        module.__all__ = list(apex_amp.__all__)
        module.__doc__ = apex_amp.__doc__
        module.__getattr__ = apex_amp.__getattr__
        setattr(module, _MARK, True)
        state_module = types.ModuleType("apex.amp._amp_state", "Apex's module holding _amp_state: a live view.")
        state_module._amp_state = apex_amp._amp_state
        state_module.master_params = apex_amp.master_params
        state_module.maybe_print = maybe_print
        setattr(state_module, _MARK, True)
        sys.modules[state_module.__name__] = state_module  # attribute apex.amp._amp_state stays the view
        lists = apex_amp.lists  # apex.amp.lists and its three modules: the very lists initialize reads
        sys.modules["apex.amp.lists"] = lists
        for name in ("functional_overrides", "torch_overrides", "tensor_overrides"):
            sys.modules[f"apex.amp.lists.{name}"] = getattr(lists, name)


def _submodule_or_error(fullname, make_error):
    """``module.name`` for a name that is a mirrored submodule (imported now), else raise ``make_error()``."""
    if has_mirror(fullname):
        return importlib.import_module(fullname)
    raise make_error()


def _stub_getattr(name):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(f"module 'apex' has no attribute {name!r}")
    return _submodule_or_error(f"apex.{name}", lambda: attribute_error(name))


class _StubApexLoader(importlib.abc.Loader):
    """Creates a stub ``apex`` package (no real apex installed) that imports ``apex.amp`` eagerly, as apex did.

    The mirrored submodules (``apex.parallel``, ``apex.optimizers``, ...) are attributes that import on first use.
    """

    def exec_module(self, module):
        setattr(module, _MARK, True)
        module.__doc__ = "amp_patch's stand-in for NVIDIA apex: apex.amp and the apex modules amp_patch provides."
        module.__getattr__ = _stub_getattr
        for name in getattr(importlib.import_module(MIRROR_ROOT), "__all__", ()):  # apex's own top-level names
            setattr(module, name, getattr(importlib.import_module(MIRROR_ROOT), name))
        importlib.import_module("apex.amp")


class _MirrorLoader(importlib.abc.Loader):
    """Creates ``apex.X`` / ``amp_C`` / ``apex_C`` holding the names of amp_patch's mirror module.

    The module is a new object (the mirror keeps its own name and spec); its names are
    the mirror's objects, and names added to the mirror later are looked up on use.
    """

    _SKIP = {"__name__", "__spec__", "__loader__", "__package__", "__path__", "__file__", "__cached__",
             "__builtins__", "__getattr__"}

    def __init__(self, source):
        self.source = source

    def exec_module(self, module):
        source = importlib.import_module(self.source)
        prefix = source.__name__ + "."
        for key, value in vars(source).items():
            if key in self._SKIP or (isinstance(value, types.ModuleType) and value.__name__.startswith(prefix)):
                continue  # submodules: the apex-side ones are imported on use (below)
            setattr(module, key, value)
        module.__getattr__ = _mirror_getattr(module.__name__, source)
        setattr(module, _MARK, True)


def _mirror_getattr(fullname, source):
    def __getattr__(name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {fullname!r} has no attribute {name!r}")
        try:
            value = getattr(source, name)
        except AttributeError:
            value = MISSING
        if value is not MISSING and getattr(value, "__name__", None) != f"{source.__name__}.{name}":
            return value  # (the mirror's own submodules are served as their apex-side modules)
        return _submodule_or_error(f"{fullname}.{name}", lambda: missing_name_error(fullname, name, source))

    return __getattr__


class _ErrorLoader(importlib.abc.Loader):
    """Raises the helpful error for an unsupported ``apex.X`` module when it is imported."""

    def exec_module(self, module):
        raise import_error(module.__name__[len("apex."):])


class _RealApexLoader(importlib.abc.Loader):
    """Runs the real apex's loader, then attaches ``apex.amp`` (old apex imported it in ``__init__``)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        if "amp" not in vars(module):
            importlib.import_module("apex.amp")


def _mirror_module_spec(fullname):
    exists, is_package = mirror_spec(fullname)
    if not exists:
        return None
    return importlib.util.spec_from_loader(fullname, _MirrorLoader(mirror_name(fullname)), is_package=is_package)


class ApexAliasFinder(importlib.abc.MetaPathFinder):
    """Answers ``apex``, ``apex.amp``, the mirrored ``apex.X``, ``amp_C``/``apex_C`` and (without a real apex)
    every other ``apex.X``; also the ``apex`` distribution's metadata."""

    def __init__(self, real_apex):
        self.real_apex = real_apex

    def find_spec(self, fullname, path, target=None):
        if fullname in TOP_LEVEL:
            return None if find_real_spec(fullname, path, skip=self) is not None else _mirror_module_spec(fullname)
        if fullname == "apex":
            return self._apex_spec(path)
        if fullname == "apex.amp":
            return importlib.util.spec_from_loader(fullname, _AmpLoader(), is_package=True)
        if not fullname.startswith("apex."):
            return None
        if is_amp_name(fullname):
            return importlib.util.spec_from_loader(fullname, _ErrorLoader())
        parent = fullname.rpartition(".")[0]
        if self.real_apex and not _ours(sys.modules.get(parent)):
            if parent != "apex" or find_real_spec(fullname, path, skip=self) is not None:
                return None  # the real apex's own module (or its own error)
            return _mirror_module_spec(fullname)  # a module this apex lacks (e.g. apex.parallel, gone since 2025)
        return _mirror_module_spec(fullname) or importlib.util.spec_from_loader(fullname, _ErrorLoader())

    def _apex_spec(self, path):
        if not self.real_apex:
            return importlib.util.spec_from_loader("apex", _StubApexLoader(), is_package=True)
        spec = find_real_spec("apex", path, skip=self)
        if spec is not None and spec.loader is not None:
            spec.loader = _RealApexLoader(spec.loader)
        return spec

    def find_distributions(self, context=None):
        """``importlib.metadata`` hook: an ``apex`` distribution unless a real one is installed."""
        return metadata.find_distributions(ApexAliasFinder, context)


def find_real_spec(name, path=None, skip=None):
    """The spec the other meta path finders give ``name`` (nothing is imported)."""
    for finder in list(sys.meta_path):
        if finder is skip or isinstance(finder, ApexAliasFinder):
            continue
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, path) if find_spec is not None else None
        if spec is not None:
            return spec
    return None


def _real_apex():
    """(found, where its amp is or None) for a real apex package, imported or not."""
    module = sys.modules.get("apex")
    if module is not None and not _ours(module):
        amp = sys.modules.get("apex.amp") or vars(module).get("amp")
        if amp is not None and not _ours(amp):
            return True, getattr(amp, "__file__", None) or repr(amp)
        locations = getattr(module, "__path__", None)
    else:
        spec = find_real_spec("apex")
        if spec is None:
            return False, None
        locations = spec.submodule_search_locations
    if locations is None:
        return True, None
    amp_spec = find_real_spec("apex.amp", list(locations))
    return True, (amp_spec.origin or "apex.amp") if amp_spec is not None else None


class AliasHandle:
    """The installed alias; ``uninstall()`` (or leaving ``with``) removes it. Nested installs share it."""

    def __init__(self, finder, saved_modules, saved_apex_attrs, force):
        self.finder = finder
        self.force = force
        self._saved_modules = saved_modules
        self._saved_apex_attrs = saved_apex_attrs  # a real apex's submodule attributes before the alias
        self._depth = 1

    @property
    def installed(self):
        return _STATE["handle"] is self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()

    def uninstall(self):
        """Drop one install; the last one restores ``sys.meta_path`` and ``sys.modules`` exactly."""
        if not self.installed:
            return
        self._depth -= 1
        if self._depth == 0:
            self._restore()

    def _restore(self):
        _STATE["handle"] = None
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        for name in [n for n in sys.modules if is_alias_name(n)]:
            if name not in self._saved_modules:
                del sys.modules[name]
        sys.modules.update(self._saved_modules)
        apex = sys.modules.get("apex")
        if apex is not None and not _ours(apex):  # a real apex: take back the modules the alias attached
            for key, value in list(vars(apex).items()):
                if _ours(value):
                    if key in self._saved_apex_attrs:
                        setattr(apex, key, self._saved_apex_attrs[key])
                    else:
                        delattr(apex, key)
        log.debug("apex alias removed")


def install_apex_alias(force=False):
    """Make ``import apex.amp`` / ``from apex import amp`` resolve to amp_patch; returns an :class:`AliasHandle`.

    Refuses (``UsageError``) when a real ``apex.amp`` is installed, unless ``force=True``.
    """
    active = _STATE["handle"]
    if active is not None:
        active._depth += 1
        return active
    real, real_amp = _real_apex()
    if real_amp is not None and not force:
        raise UsageError(f"a real apex.amp is installed ({real_amp}); amp_patch will not shadow it. Uninstall it "
                         "(pip uninstall apex) or pass force=True (amp-patch run --force) to use amp_patch's "
                         "apex.amp instead")
    saved = {n: m for n, m in sys.modules.items() if is_alias_name(n)}
    apex = saved.get("apex")
    saved_attrs = {k: v for k, v in vars(apex).items() if isinstance(v, types.ModuleType)} if apex else {}
    for name in [n for n in saved if is_amp_name(n)]:
        del sys.modules[name]  # force: the real apex.amp steps aside until uninstall
    finder = ApexAliasFinder(real)
    sys.meta_path.insert(0, finder)
    handle = _STATE["handle"] = AliasHandle(finder, saved, saved_attrs, force)
    if apex is not None and real:
        try:
            importlib.import_module("apex.amp")  # so that `import apex; apex.amp...` works too
        except BaseException:
            handle._restore()
            raise
    log.debug("apex alias installed (real apex: %s, forced: %s)", real, force)
    return handle


def uninstall_apex_alias():
    """Remove the alias whatever the number of installs; a no-op when it is not installed."""
    handle = _STATE["handle"]
    if handle is not None:
        handle._restore()


def apex_alias_installed():
    return _STATE["handle"] is not None
