"""An op-list entry's torch bounds (``min_torch``/``max_torch``): whether this torch is inside them, and what a
version YAML read as a number was written as."""
import re

import torch


def version_message(name, key, value, path, line):
    """A version YAML read as a number names what was written: ``2.10`` unquoted is the float 2.1."""
    if not isinstance(value, float):
        return f'{name}: {key} {value!r} is not a version string such as "2.1" (quote it)'
    written = written_token(path, line, key) or str(value)
    return (f"{name}: {key}: YAML read {written} as the number {value!r}" + (f", not the version {written}"
            if written != str(value) else "") + f'; quote the version: {key}: "{written}"')


def written_token(path, line, key):
    """The number as the file spells it, on the entry's line or the few after it (None if not found)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()[line - 1:line + 8]
    except (OSError, TypeError, ValueError):
        return None
    found = (re.search(rf"\b{key}\s*:\s*([0-9][0-9.]*)", text) for text in lines)
    return next((m.group(1) for m in found if m), None)


def release(text):
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; ``"2.16.0a0+git1234"`` -> ``(2, 16, 0)``."""
    return tuple(torch.torch_version.Version(str(text)).release)


def version_skip(spec, version=None):
    """Why ``spec`` is inactive on ``version`` (this torch), or None. A bound covers every release it prefixes:
    ``max_torch: "2.13"`` keeps 2.13.1 and 2.13.0+cpu, and drops 2.14."""
    running = release(version or torch.__version__)
    shown = version or torch.__version__
    if "min_torch" in spec:
        bound = release(spec["min_torch"])
        if running[:len(bound)] < bound:
            return f"needs torch >= {spec['min_torch']}, this is {shown}"
    if "max_torch" in spec:
        bound = release(spec["max_torch"])
        if running[:len(bound)] > bound:
            return f"needs torch <= {spec['max_torch']}, this is {shown}"
    return None
