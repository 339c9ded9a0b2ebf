"""Package metadata for the aliased ``apex``: ``importlib.metadata.version("apex")`` answers while the alias is on.

Libraries decide whether apex is installed from its distribution metadata (the
Hugging Face Trainer's ``--half_precision_backend apex`` checks
``importlib.metadata.version("apex")``). :func:`find_distributions` is the alias
finder's ``find_distributions`` hook: it yields an ``apex`` distribution whose
version is amp_patch's, unless a real apex distribution is installed (that one
keeps answering).
"""
import importlib.metadata
import os
import re
import sys

_NAME = "apex"


def _normalized(name):
    return re.sub(r"[-_.]+", "_", name).lower()


class AliasDistribution(importlib.metadata.Distribution):
    """The ``apex`` distribution the alias stands in for (metadata only: no files, no entry points)."""

    def read_text(self, filename):
        from .. import __version__
        from .mirror import TOP_LEVEL, has_mirror

        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: {_NAME}\nVersion: {__version__}\n"
                    "Summary: amp_patch's apex import alias (amp-patch run): apex.amp and the apex modules "
                    "amp_patch provides; see amp_patch's docs/migration.md\n")
        if filename == "top_level.txt":
            return "\n".join([_NAME] + [name for name in TOP_LEVEL if has_mirror(name)]) + "\n"
        return None

    def locate_file(self, path):
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), str(path))


def _real_distribution(skip_type):
    """An installed apex distribution found by the other finders, or None."""
    context = importlib.metadata.DistributionFinder.Context(name=_NAME)
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_distributions", None)
        if find is None or isinstance(finder, skip_type):
            continue
        found = next(iter(find(context)), None)
        if found is not None:
            return found
    return None


def find_distributions(skip_type, context=None):
    """The alias's distributions for ``context``: ``[AliasDistribution()]`` or nothing."""
    context = context or importlib.metadata.DistributionFinder.Context()
    if context.name is not None and _normalized(context.name) != _NAME:
        return iter(())
    if "path" in vars(context):  # a search of chosen directories, not of the running interpreter
        return iter(())
    if _real_distribution(skip_type) is not None:
        return iter(())
    return iter([AliasDistribution()])
