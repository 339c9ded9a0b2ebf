"""Where the alias finds the modules it serves as ``apex.<sub>`` and as Apex's compiled extensions (``amp_C``, ...).

amp_patch keeps its implementations of Apex's modules in a tree that mirrors
Apex's own: ``apex.parallel.distributed`` is ``amp_patch.legacy.apex.parallel.distributed``,
and the top-level extension modules Apex installed beside ``apex`` (``TOP_LEVEL``) are
``amp_patch.legacy.amp_C``, ``apex_C``, ``syncbn``, ``fused_adam_cuda``, .... Whatever exists in that
tree is provided by the alias; everything else keeps the ``ApexImportError`` path.
(``apex.amp`` is the exception: it is :mod:`amp_patch.legacy.apex_amp`.)
Nothing here imports a mirror module except :func:`mirror_spec` for a submodule,
which imports its parent package, as any ``find_spec`` does.
"""
import importlib.util
import sys

MIRROR_ROOT = "amp_patch.legacy.apex"
# Apex's compiled extension modules installed beside ``apex`` that public scripts import by name
_EXTENSIONS = ("amp_C", "apex_C", "syncbn", "fused_adam_cuda", "fused_lamb_cuda", "fused_layer_norm_cuda",
               "xentropy_cuda", "scaled_softmax_cuda", "scaled_masked_softmax_cuda",
               "generic_scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
TOP_LEVEL = {name: f"amp_patch.legacy.{name}" for name in _EXTENSIONS}


def is_apex_name(name):
    return name == "apex" or name.startswith("apex.")


def is_amp_name(name):
    return name == "apex.amp" or name.startswith("apex.amp.")


def is_alias_name(name):
    """Every ``sys.modules`` name the alias may create (and removes again on uninstall)."""
    return is_apex_name(name) or name in TOP_LEVEL


def mirror_name(fullname):
    """The amp_patch module that implements ``fullname`` (``apex.X.Y``, ``amp_C``, ``apex_C``), or None."""
    if fullname in TOP_LEVEL:
        return TOP_LEVEL[fullname]
    if fullname.startswith("apex.") and not is_amp_name(fullname):
        return MIRROR_ROOT + fullname[len("apex"):]
    return None


def mirror_spec(fullname):
    """(exists, is_package) for the mirror of ``fullname``; (False, False) when amp_patch has none."""
    name = mirror_name(fullname)
    if name is None:
        return False, False
    if name in sys.modules:
        module = sys.modules[name]
        return module is not None, hasattr(module, "__path__")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False, False
    if spec is None:
        return False, False
    return True, spec.submodule_search_locations is not None


def has_mirror(fullname):
    return mirror_spec(fullname)[0]
