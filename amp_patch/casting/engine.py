"""The casting engine: turns an op table into installed wrappers, and back.

One engine belongs to one session (or to one ``amp_patch.autocast()`` region
when no session is active). It owns the patcher, the cast cache and the
per-thread switch the wrappers read.
"""
import logging
import sys
import threading

import torch

from .._torch import dynamo_tables
from .._torch.compat import tracing
from .._torch.hooks import MODULE_CALL_CODE, running
from ..patching.patcher import Patcher
from ..patching.resolve import resolve_target
from .cache import CastCache, make_to_half
from .interop import forked, native_regions, recompute, warn_site
from .native_fast import FastRegions, native_off, off_only
from .native_plan import native_keys, native_sees, off_entries
from .scopes import ScopeRuntime, passthrough, unmatched_globs
from .wrappers import DisabledThreads, make_wrapper

log = logging.getLogger("amp_patch")
_compiling = tracing
_getframe = sys._getframe


class CastingEngine:
    """Installs the wrappers for an :class:`~amp_patch.config.oplist.OpTable` plus user registrations."""

    def __init__(self, table, *, half_dtype=torch.float16, allow_banned=False, registrations=(), activation=None,
                 hybrid=()):
        self.table = table
        # device types whose native autocast casts the ops that match it inside forwards (native_fast); () none
        self.hybrid = tuple(hybrid)
        # what the engine may ask of activation (the live engine, a temporary region), injected by the session
        # layer (amp_patch.session.state.ACTIVATION); None: a checkpoint recompute after this engine's region
        # closed runs uncast
        self.activation = activation
        self.half_dtype = half_dtype
        self.fp8_recipe = getattr(table, "fp8_recipe", "tensorwise")  # how the fp8 category scales
        self.allow_banned = allow_banned
        self.registrations = tuple(registrations)
        self.forwards = {}  # thread ident -> depth of session-model forwards open there (deinitialize checks it)
        self.outer_calls = {}  # thread ident -> the frame of torch's call running its outermost forward (or None)
        self.cache = CastCache(self.forwards)  # (used only in those forwards and autocast() regions)
        self.disabled = DisabledThreads()
        self._casts_off = _CastsOff(self.disabled)  # (holds no state of a use: one serves every use, nested too)
        self.to_half = make_to_half(half_dtype, self.cache, self.disabled)
        self.patcher = Patcher()
        self.tracer = None
        self._dynamo_table = None  # dynamo's table as built before patching (see dynamo_tables)
        self.paused = set()  # threads inside an optimizer step
        self._threads = threading.local()  # .seen: this thread began a forward (tells a reused ident from it)
        self.scopes = ScopeRuntime(table.scopes) if getattr(table, "scopes", ()) else None
        self.device_type = native_regions.engine_device_type()  # whose torch.autocast(enabled=False) regions count
        self.native_regions = {}  # thread ident -> open native autocast regions of device_type (native_regions)
        self.fast = None  # the hybrid engine's FastRegions while installed without a tracer
        self.native_keys = frozenset()  # (target, name) of the entries left to native autocast in fast regions

    @property
    def installed(self):
        return len(self.patcher) > 0

    def install(self, tracer=None):
        """Install one wrapper per entry (registrations override list entries of the same site).

        With a ``tracer`` the wrappers are the recording variants (see ``amp_patch.observe.trace``); without one
        they contain no tracing code at all, so tracing off costs nothing.
        """
        self.tracer = tracer
        forked.watch(self)
        self._dynamo_table = dynamo_tables.build_before_patching()
        registered = {(id(reg.owner), reg.entry.name) for reg in self.registrations}
        owners = {}
        scoped = self._scoped_entries()
        self._plan_fast(scoped)
        extra = tuple(e for k, e in scoped.items() if k not in self.table) + self._off_entries
        try:
            for entry in self.table.entries + extra:
                owner = owners.get(entry.target) or owners.setdefault(entry.target, resolve_target(entry.target))
                if (id(owner), entry.name) not in registered:
                    self._install_one(owner, entry, (entry.target, entry.name) in scoped)
            for reg in self.registrations:
                self._install_one(reg.owner, reg.entry)
            recompute.install(self, self.patcher)
            native_regions.install(self, self.patcher)
            warn_site.install(self.patcher)
        except BaseException:
            self.patcher.restore_all()
            raise
        if self.scopes is not None:
            self.scopes.refresh()
        log.debug("installed %d wrappers (%s)", len(self.patcher), self.half_dtype)

    def _scoped_entries(self):
        """(target, name) -> a representative entry, for every op some scope names (to install a site for it)."""
        if self.scopes is None:
            return {}
        return {(e.target, e.name): e for scope in self.scopes.scopes for e in scope.entries}

    def _plan_fast(self, scoped):
        """Hybrid, without a tracer: which entries native autocast casts in fast regions, which wrappers only turn
        native off there (native_plan); else none, and every op takes the Python path."""
        self.fast, self.native_keys, self._off_entries, self._native_sees = None, frozenset(), (), frozenset()
        if not self.hybrid or self.tracer is not None:
            return
        keep = set(scoped) | {(reg.entry.target, reg.entry.name) for reg in self.registrations}
        devices = self.hybrid
        self.native_keys = native_keys(self.table, devices, keep)
        if self.native_keys:
            self.fast = FastRegions(self, devices)
            self._off_entries = off_entries(self.table, devices, keep)
            self._native_sees = native_sees(devices)

    def _install_one(self, owner, entry, scoped=False):
        method, fast = isinstance(owner, type), self.fast
        if fast is not None and entry.category == "native_off":
            self.patcher.install(owner, entry.name, lambda original: off_only(original, entry, fast))
            return
        if self.tracer is not None:
            wrap = lambda original, e: self.tracer.wrap(original, e, self, method=method)  # noqa: E731
        elif fast is not None and not scoped and (entry.target, entry.name) in self.native_keys:
            view = _SwitchView(self, fast.bypass)  # passes through in fast regions too
            wrap = lambda original, e: make_wrapper(original, e, view, method=method)  # noqa: E731
        elif fast is not None and (scoped or (entry.target, entry.name) in self._native_sees):
            wrap = lambda original, e: native_off(make_wrapper(original, e, self, method=method), fast)  # noqa: E731
        else:
            wrap = lambda original, e: make_wrapper(original, e, self, method=method)  # noqa: E731
        if not scoped:
            self.patcher.install(owner, entry.name, lambda original: wrap(original, entry))
            return
        self.patcher.install(owner, entry.name, lambda original: self._scoped_wrapper(original, entry, wrap))

    def _scoped_wrapper(self, original, entry, wrap):
        """The dispatcher of an op some scope names: one wrapper per scope naming it, the global one otherwise."""
        key = (entry.target, entry.name)
        for scope in self.scopes.scopes:
            for scoped_entry in scope.entries:
                if (scoped_entry.target, scoped_entry.name) == key:
                    self.scopes.set_wrapper(scope, scoped_entry, wrap(original, scoped_entry))
        base = wrap(original, entry) if entry.scope is None else passthrough(original)
        if entry.scope is not None and self.fast is not None:
            base = native_off(base, self.fast)
        return self.scopes.dispatcher(key, base, original)

    def attach_scopes(self, models):
        """Hook the modules the scopes' globs match (a session calls this with its models)."""
        if self.scopes is not None:
            self.scopes.detach()
            self.scopes.attach(models)
            for scope in unmatched_globs(self.scopes.scopes, models):
                log.warning("scope %r (%s:%s) matches no module of the model(s); it has no effect. "
                            "Module paths are as model.named_modules() spells them (check with amp-patch "
                            "validate --job MODULE:FUNCTION)", scope.glob, scope.path, scope.line)

    def retrace(self, tracer):
        """Reinstall every wrapper, recording into ``tracer`` (or, with None, the plain ones). With a tracer every
        op takes the Python path (the recording wrappers see every call), as with ``cast_engine="python"``."""
        if self.fast is not None:
            self.fast.clear()
            self.disabled.on_change = None
        self.patcher.restore_all()
        self.install(tracer)

    def uninstall(self):
        if self.scopes is not None:
            self.scopes.detach()
        if self.fast is not None:
            self.fast.clear()  # native autocast back as this thread's region found it
        self.patcher.restore_all()
        dynamo_tables.forget_after_unpatching(self._dynamo_table)
        self.cache.clear()
        self.disabled.close()  # wrappers captured or re-patched over by others pass through from now on
        self.paused.clear()
        self.native_regions.clear()

    def clear_cache(self):
        self.cache.clear()

    def enter_region(self):
        """An ``amp_patch.autocast()`` region opens in this thread: the cast cache serves it."""
        self.cache.enter_region()

    def exit_region(self):
        self.cache.exit_region()

    def begin_forward(self, *hook_args):
        """A forward of a session's model starts (its forward pre-hook, ``hook_args`` ignored): end a step pause,
        drop the casts of the last forward (a weight may have changed through ``.data`` since, which nothing can
        detect: see ``CastCache``)."""
        if self.paused:
            self.resume_after_step()
        if _compiling():  # dynamo traces the hooks: no thread ident in the graph (a graph break), no cache there
            return
        self.cache.entries.clear()
        ident = threading.get_ident()
        depth = self.forwards.get(ident, 0)
        if depth:
            depth = self._nested_depth(ident, depth)
        if not depth:
            self._threads.seen = True
            frame = _getframe(1)  # (module_call_frame(1): torch's call running this hook)
            self.outer_calls[ident] = frame if frame.f_code is MODULE_CALL_CODE else None
        self.forwards[ident] = depth + 1
        if self.fast is not None:
            self.fast.open_eager(ident)

    def _nested_depth(self, ident, depth):
        """The depth a forward starting inside another one finds: 0 where that one is no longer running, cut off by
        a ``BaseException`` (Ctrl-C runs no always-called hook: left open, native's cache would keep the weights'
        casts across checkpoints an eval loop loads) or left by a dead thread whose ident this one reuses."""
        if not getattr(self._threads, "seen", False):
            return self._forget_dead_thread(ident)
        if self._cut_off(ident):
            self.forget_forwards()
            return 0
        return depth

    def _cut_off(self, ident):
        """Whether this thread's outermost forward no longer runs (its torch call's frame is gone: Ctrl-C where the
        guard on the model's forward, ``session.call_guard``, could not see it)."""
        frame = self.outer_calls.get(ident)
        return frame is not None and not running(frame)

    def _forget_dead_thread(self, ident):
        """This thread reuses the ident of a thread that died inside a forward (it raised there and no scale_loss
        of that thread forgot it): drop what that thread left, keyed by the ident, as a new thread has none."""
        self.forwards.pop(ident, None)
        self.outer_calls.pop(ident, None)
        if self.fast is not None:
            self.fast.forget_dead_thread(ident)
        self._threads.seen = True
        return 0

    def end_forward(self, *hook_args):
        """A forward of a session's model returned or raised (torch's always-called hook, ``hook_args`` ignored;
        for Ctrl-C, the guard on the model's forward runs it): the outermost drops the casts. (One cut off where the
        guard cannot see it is forgotten at the thread's next forward, scale_loss, optimizer step or
        ``load_state_dict``.)"""
        if _compiling():
            return
        ident = threading.get_ident()
        if self.fast is not None:
            self.fast.close_eager(ident)
        depth = self.forwards.get(ident, 0) - 1
        if depth > 0:
            self.forwards[ident] = depth
        else:
            self.forwards.pop(ident, None)
            self.outer_calls.pop(ident, None)
            if ident not in self.cache.regions:  # the region is over: keep no casts (and no weights) alive
                self.cache.entries.clear()

    def drop_cut_off(self):
        """Where weights may change outside a forward (an optimizer step, a ``load_state_dict``): a forward of this
        thread cut off by Ctrl-C (its outermost call no longer running) is forgotten first, so no cast of the old
        weights (native's cache, the Python engine's) serves what runs before the model's next forward (a submodule
        called on its own after a checkpoint load read the loaded weights' old casts)."""
        ident = threading.get_ident()
        if self._cut_off(ident):
            self.forget_forwards()
            if ident not in self.cache.regions:
                self.cache.entries.clear()

    def forget_forwards(self):
        self.forwards.pop(threading.get_ident(), None)
        self.outer_calls.pop(threading.get_ident(), None)
        if self.fast is not None:
            self.fast.forget()

    def loss_begins(self):
        """A ``scale_loss`` block opens in this thread: :meth:`resume_after_step` and :meth:`forget_forwards` in
        one frame (each guard skips a call that would do nothing: every iteration)."""
        ident = threading.get_ident()
        paused = self.paused
        if paused and ident in paused:
            self.resume_after_step()  # (its undo of a pause an interrupt cut short)
        forwards = self.forwards
        if forwards:
            forwards.pop(ident, None)
            self.outer_calls.pop(ident, None)
        fast = self.fast
        if fast is not None and fast.depth:
            fast.forget()

    def pause_for_step(self):
        """Optimizer math runs on fp32 params/grads: no wrapper has anything to cast there, so skip them for
        the step (the in-place ops of an optimizer step are most of O1's per-step wrapper calls). In this one frame:
        the switch's ``enter`` and the fast regions' ``sync``, whose one outcome with native off in the thread (no
        forward's region open: the usual pause) is the matching wrappers' switch on. The pause is recorded first and
        :meth:`resume_after_step` undoes only what is there: an interrupt (Ctrl-C) anywhere leaves it undoable."""
        if self.outer_calls:
            self.drop_cut_off()
        ident = threading.get_ident()
        paused = self.paused
        if ident in paused:
            return
        paused.add(ident)
        disabled, fast = self.disabled, self.fast
        if type(disabled) is not DisabledThreads:  # (a closed switch: its enter does nothing)
            disabled.enter()
            return
        disabled[ident] = disabled.get(ident, 0) + 1  # (DisabledThreads.enter)
        if fast is not None:
            if ident in fast.saved:
                fast.sync(ident)
            else:
                fast.bypass[ident] = 1  # (FastRegions.sync with native off in the thread and casting off)

    def in_step(self):
        """Whether this thread is inside an optimizer step's pause (the trace leaves those calls out)."""
        return threading.get_ident() in self.paused

    def resume_after_step(self):
        """End a step pause; also called before each forward of the models and on scale_loss entry, so a step
        that raised cannot leave casting off in this thread. One frame, as :meth:`pause_for_step`'s (the switch's
        ``exit``; the fast regions' ``sync`` where a forward is open in the thread, else its outcome)."""
        paused = self.paused
        if not paused:
            return
        ident = threading.get_ident()
        if ident not in paused:
            return
        disabled, fast = self.disabled, self.fast
        if type(disabled) is not DisabledThreads:
            paused.discard(ident)
            disabled.exit()
            return
        depth = disabled.get(ident, 0) - 1  # (DisabledThreads.exit; none to end where an interrupt cut the pause)
        if depth > 0:
            disabled[ident] = depth
        else:
            disabled.pop(ident, None)
        if fast is not None:
            if ident in fast.depth or ident in fast.saved:
                fast.sync(ident)
            elif depth <= 0:
                fast.bypass.pop(ident, None)
        paused.discard(ident)  # (last: an interrupt before leaves the pause to end again)

    def casts_disabled(self):
        """A context manager: the body runs with casting off in this thread (re-entrant, exception-safe)."""
        return self._casts_off


class _CastsOff:
    """``casts_disabled()``'s context manager (a class: a step's bookkeeping enters it several times)."""

    __slots__ = ("switch",)

    def __init__(self, switch):
        self.switch = switch

    def __enter__(self):
        self.switch.enter()

    def __exit__(self, *exc):
        self.switch.exit()


class _SwitchView:
    """The engine as the wrappers of matching ops see it: the same casters, ``bypass`` as their switch."""

    def __init__(self, engine, switch):
        self.disabled = switch
        self.to_half = engine.to_half
        self.allow_banned = engine.allow_banned
