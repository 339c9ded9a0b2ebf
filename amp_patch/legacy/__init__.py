"""Run scripts written for NVIDIA Apex's amp (``from apex import amp``) on amp_patch, unmodified.

- ``amp-patch run script.py [args...]`` (or ``python -m amp_patch.legacy run ...``) runs a script as
  ``__main__`` with the ``apex`` alias installed; :func:`run_script` is the same call in Python.
- :func:`install_apex_alias` installs the alias in this process (notebooks, launchers); it returns a
  handle whose ``uninstall()`` (or ``with`` block) removes it again; :func:`uninstall_apex_alias` too.
- ``from amp_patch.legacy import amp`` is the one-line edit alternative: the same functions ``apex.amp`` has
  under the alias (a distinct module object).
- ``amp.init()`` (Apex's old handle API) is in :mod:`amp_patch.legacy.handle`; ``apex.amp._amp_state`` (a live
  view of the session) in :mod:`amp_patch.legacy.amp_state`.
- The other Apex modules the alias serves (``apex.parallel``, ``apex.optimizers``, ..., ``amp_C``, ``apex_C``)
  live in :mod:`amp_patch.legacy.apex` and beside it (:mod:`amp_patch.legacy.mirror` says how they are found);
  ``importlib.metadata`` sees an ``apex`` distribution while the alias is installed (:mod:`amp_patch.legacy.metadata`).
See docs/migration.md.
"""
from . import apex_amp as amp
from .alias import AliasHandle, apex_alias_installed, install_apex_alias, uninstall_apex_alias
from .cli import add_parser, main, run_command, run_script
from .unsupported import ApexAttributeError, ApexFeatureError, ApexImportError

__all__ = ["amp", "install_apex_alias", "uninstall_apex_alias", "apex_alias_installed", "AliasHandle",
           "run_script", "run_command", "add_parser", "main", "ApexFeatureError", "ApexAttributeError",
           "ApexImportError"]
