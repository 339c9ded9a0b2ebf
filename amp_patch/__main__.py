"""``python -m amp_patch ...`` runs the ``amp-patch`` command line (see :mod:`amp_patch.tools.cli`)."""
import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
