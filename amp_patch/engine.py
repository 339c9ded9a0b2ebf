"""The casting engine: turns an op table into installed wrappers, and back.

One engine belongs to one session (or to one ``amp_patch.autocast()`` region
when no session is active). It owns the patcher, the cast cache and the
per-thread switch the wrappers read.
"""
import contextlib
import logging
import threading

import torch

from ._resolve import resolve_target
from .casting import CastCache, DisabledThreads, make_to_half, make_wrapper
from .patcher import Patcher

log = logging.getLogger("amp_patch")


class CastingEngine:
    """Installs the wrappers for an :class:`~amp_patch.oplist.OpTable` plus user registrations."""

    def __init__(self, table, *, half_dtype=torch.float16, allow_banned=False, registrations=()):
        self.table = table
        self.half_dtype = half_dtype
        self.allow_banned = allow_banned
        self.registrations = tuple(registrations)
        self.cache = CastCache()
        self.disabled = DisabledThreads()
        self.to_half = make_to_half(half_dtype, self.cache)
        self.patcher = Patcher()
        self.tracer = None
        self._paused = set()  # threads inside an optimizer step

    @property
    def installed(self):
        return len(self.patcher) > 0

    def install(self, tracer=None):
        """Install one wrapper per entry (registrations override list entries of the same site).

        With a ``tracer`` the wrappers are the recording variants (see ``amp_patch.tracing``); without one
        they contain no tracing code at all, so tracing off costs nothing.
        """
        self.tracer = tracer
        registered = {(id(reg.owner), reg.entry.name) for reg in self.registrations}
        owners = {}
        try:
            for entry in self.table.entries:
                owner = owners.get(entry.target) or owners.setdefault(entry.target, resolve_target(entry.target))
                if (id(owner), entry.name) not in registered:
                    self._install_one(owner, entry)
            for reg in self.registrations:
                self._install_one(reg.owner, reg.entry)
        except BaseException:
            self.patcher.restore_all()
            raise
        log.debug("installed %d wrappers (%s)", len(self.patcher), self.half_dtype)

    def _install_one(self, owner, entry):
        method = isinstance(owner, type)
        if self.tracer is None:
            make = lambda original: make_wrapper(original, entry, self, method=method)  # noqa: E731
        else:
            make = lambda original: self.tracer.wrap(original, entry, self, method=method)  # noqa: E731
        self.patcher.install(owner, entry.name, make)

    def retrace(self, tracer):
        """Reinstall every wrapper, recording into ``tracer`` (or, with None, the plain ones)."""
        self.patcher.restore_all()
        self.install(tracer)

    def uninstall(self):
        self.patcher.restore_all()
        self.cache.clear()

    def clear_cache(self):
        self.cache.clear()

    def pause_for_step(self):
        """Optimizer math runs on fp32 params/grads: no wrapper has anything to cast there, so skip them for
        the step (the in-place ops of an optimizer step are most of O1's per-step wrapper calls)."""
        ident = threading.get_ident()
        if ident not in self._paused:
            self._paused.add(ident)
            self.disabled.enter()

    def resume_after_step(self):
        """End a step pause; also called before each forward of the models and on scale_loss entry, so a step
        that raised cannot leave casting off in this thread."""
        paused = self._paused
        if paused and threading.get_ident() in paused:
            paused.discard(threading.get_ident())
            self.disabled.exit()

    @contextlib.contextmanager
    def casts_disabled(self):
        """Run the body with casting off in this thread (re-entrant, exception-safe)."""
        self.disabled.enter()
        try:
            yield
        finally:
            self.disabled.exit()
