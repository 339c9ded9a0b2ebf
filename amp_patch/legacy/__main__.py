"""``python -m amp_patch.legacy run script.py [args...]``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
