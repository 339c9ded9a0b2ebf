"""Warnings torch raises inside a patched op name the user's line, not amp_patch's wrapper.

torch attributes its deprecation and misuse warnings to its caller (``warnings.warn(..., stacklevel=N)``, e.g.
``F.softmax(x)`` without ``dim``). Under O1 that caller is amp_patch's wrapper, so the warning would point at
``amp_patch/casting/wrappers.py``. While an engine is installed, ``warnings._showwarnmsg`` (what both the C and
the Python ``warnings.warn`` call to show a warning, also under ``catch_warnings(record=True)``) is wrapped: a
warning attributed to a file of this package is re-attributed to the first frame outside amp_patch and torch,
the line that called the op. Nothing runs on the wrappers' hot path.

One difference from plain torch remains: the "print once per location" registry is keyed where ``warnings``
first attributed the warning (the wrapper's line), so under the ``default`` action two different user lines that
trigger the same warning text print it once, not twice.
"""
import os
import sys
import warnings

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # amp_patch/
_SKIPPED = (_PACKAGE + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
            os.path.abspath(warnings.__file__))


def install(patcher):
    """Wrap ``warnings._showwarnmsg`` through ``patcher`` (undone with the engine's other patches)."""
    patcher.install(warnings, "_showwarnmsg", _attributing)


def _attributing(original):
    def _showwarnmsg(msg):
        if os.path.abspath(msg.filename).startswith(_PACKAGE + os.sep):
            frame = _caller_outside()
            if frame is not None:
                msg = warnings.WarningMessage(msg.message, msg.category, frame.f_code.co_filename, frame.f_lineno,
                                              msg.file, None, msg.source)
        return original(msg)

    return _showwarnmsg


def _caller_outside():
    """The innermost frame on the stack whose file is neither amp_patch's, torch's nor ``warnings``'."""
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIPPED):
        frame = frame.f_back
    return frame
