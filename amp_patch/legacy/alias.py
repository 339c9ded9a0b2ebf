"""The opt-in ``apex`` import alias: ``import apex.amp`` / ``from apex import amp`` get amp_patch.

:func:`install_apex_alias` puts one :class:`ApexAliasFinder` first on
``sys.meta_path``. Without a real ``apex`` installed the finder provides a stub
``apex`` package (``apex.amp`` is amp_patch; other ``apex.X`` imports raise an
:class:`~amp_patch.legacy.unsupported.ApexImportError` naming the alternative).
With a real ``apex`` it provides only ``apex.amp`` and leaves the rest to apex;
if that apex has its own ``apex.amp`` the alias refuses unless ``force=True``.
:meth:`AliasHandle.uninstall` (or :func:`uninstall_apex_alias`) restores
``sys.meta_path`` and every ``apex`` entry of ``sys.modules`` as they were.
"""
import importlib
import importlib.abc
import importlib.util
import logging
import sys

from ..errors import UsageError
from . import apex_amp
from .unsupported import attribute_error, import_error

log = logging.getLogger("amp_patch")
_MARK = "__amp_patch_alias__"
_STATE = {"handle": None}


def _is_apex_name(name):
    return name == "apex" or name.startswith("apex.")


def _ours(module):
    return getattr(module, "__dict__", {}).get(_MARK, False)


class _AmpLoader(importlib.abc.Loader):
    """Creates ``apex.amp``: a package holding amp_patch's Apex surface."""

    def exec_module(self, module):
        for name in apex_amp.__all__:
            setattr(module, name, getattr(apex_amp, name))
        module.__all__ = list(apex_amp.__all__)
        module.__doc__ = apex_amp.__doc__
        module.__getattr__ = apex_amp.__getattr__
        setattr(module, _MARK, True)


def _stub_getattr(name):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(f"module 'apex' has no attribute {name!r}")
    raise attribute_error(name)


class _StubApexLoader(importlib.abc.Loader):
    """Creates a stub ``apex`` package (no real apex installed) that imports ``apex.amp`` eagerly, as apex did."""

    def exec_module(self, module):
        setattr(module, _MARK, True)
        module.__doc__ = "amp_patch's stand-in for NVIDIA apex: only apex.amp is provided."
        module.__getattr__ = _stub_getattr
        importlib.import_module("apex.amp")


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


class ApexAliasFinder(importlib.abc.MetaPathFinder):
    """Answers ``apex``, ``apex.amp`` and (without a real apex) every other ``apex.X``."""

    def __init__(self, real_apex):
        self.real_apex = real_apex

    def find_spec(self, fullname, path, target=None):
        if not _is_apex_name(fullname):
            return None
        if fullname == "apex":
            if not self.real_apex:
                return importlib.util.spec_from_loader("apex", _StubApexLoader(), is_package=True)
            spec = find_real_spec("apex", path, skip=self)
            if spec is not None and spec.loader is not None:
                spec.loader = _RealApexLoader(spec.loader)
            return spec
        if fullname == "apex.amp":
            return importlib.util.spec_from_loader(fullname, _AmpLoader(), is_package=True)
        if fullname.startswith("apex.amp.") or not self.real_apex:
            return importlib.util.spec_from_loader(fullname, _ErrorLoader())
        return None


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

    def __init__(self, finder, saved_modules, saved_amp_attr, force):
        self.finder = finder
        self.force = force
        self._saved_modules = saved_modules
        self._saved_amp_attr = saved_amp_attr
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
        for name in [n for n in sys.modules if _is_apex_name(n)]:
            if name not in self._saved_modules:
                del sys.modules[name]
        sys.modules.update(self._saved_modules)
        apex = sys.modules.get("apex")
        if apex is not None and _ours(vars(apex).get("amp")):
            if self._saved_amp_attr is None:
                delattr(apex, "amp")
            else:
                apex.amp = self._saved_amp_attr
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
    saved = {n: m for n, m in sys.modules.items() if _is_apex_name(n)}
    apex = saved.get("apex")
    saved_amp_attr = vars(apex).get("amp") if apex is not None else None
    for name in [n for n in saved if n == "apex.amp" or n.startswith("apex.amp.")]:
        del sys.modules[name]  # force: the real apex.amp steps aside until uninstall
    finder = ApexAliasFinder(real)
    sys.meta_path.insert(0, finder)
    handle = _STATE["handle"] = AliasHandle(finder, saved, saved_amp_attr, force)
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
