"""What the speed report measures on its probe steps: host reads of tensor values, dtype casts, module times.

Each probe is a context manager that undoes itself exactly on exit, and is active only around the probe steps
(whose times are not the report's step times):

- :class:`HostReads` patches the ``torch.Tensor`` methods that read a value on the host (``.item()``,
  ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()``/``int()``/``float()`` on a tensor, printing or formatting
  one) through a :class:`~amp_patch.patching.patcher.Patcher` (so the registry lists them while they are
  installed) and records each call made from the user's code with its ``file:line``. On the CPU nothing waits,
  but each is a device sync once the job runs on a GPU: the advice holds before the job gets there.
- :class:`CastTimer` counts and times every dtype cast (``aten._to_copy`` with a new dtype) in a dispatch mode.
- :class:`ModuleTimer` times the forward of chosen modules with forward hooks.
"""
import contextlib
import os
import sys
import sysconfig
import threading
import time

import torch

from ...patching.patcher import Patcher
from ..experiment.variants import CastCounter, count_syncs

#: Tensor methods that read a tensor's value on the host (a device sync on CUDA), with the name the report uses.
HOST_READS = {"item": ".item()", "tolist": ".tolist()", "cpu": ".cpu()", "numpy": ".numpy()",
              "__bool__": "bool(tensor)", "__int__": "int(tensor)", "__float__": "float(tensor)",
              "__repr__": "printing a tensor", "__format__": "formatting a tensor"}
_TO_COPY = torch.ops.aten._to_copy.default
_ATEN = torch.ops.aten
#: matmul ops -> the index of their first matrix argument (addmm and baddbmm take the bias first)
_MATMULS = {_ATEN.mm.default: 0, _ATEN.bmm.default: 0, _ATEN.addmm.default: 1, _ATEN.baddbmm.default: 1}
_TORCH_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "")
_AMP_PATCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "")
_SPEED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")  # the harness: the step's own frames
_NOT_USER = (_AMP_PATCH_DIR, os.path.join(os.path.abspath(sysconfig.get_paths()["stdlib"]), ""))
_LIBRARIES = tuple({os.path.join(os.path.abspath(sysconfig.get_paths()[k]), "") for k in ("purelib", "platlib")})


def user_site(frame, through_amp_patch=False, libraries=False):
    """``file:line`` of the first caller outside torch (and, ``through_amp_patch``, outside amp_patch's casting
    wrappers, but never past the speed harness) when it is the user's code (not amp_patch, not the stdlib); with
    ``libraries``, a caller in site-packages is returned as its absolute ``path:line`` (the caller names the
    module instead)."""
    skip = (_TORCH_DIR, _AMP_PATCH_DIR) if through_amp_patch else (_TORCH_DIR,)
    while frame is not None and frame.f_code.co_filename.startswith(skip) \
            and not frame.f_code.co_filename.startswith(_SPEED_DIR):
        frame = frame.f_back
    if frame is None:
        return None
    path = frame.f_code.co_filename
    if path.startswith("<") or os.path.abspath(path).startswith(_NOT_USER):
        return None
    if libraries and os.path.abspath(path).startswith(_LIBRARIES):
        return f"{os.path.abspath(path)}:{frame.f_lineno}"
    cwd = os.path.join(os.getcwd(), "")
    shown = os.path.relpath(path) if os.path.abspath(path).startswith(cwd) else path
    return f"{shown}:{frame.f_lineno}"


class HostReads:
    """Records host reads of tensor values made by the user's code while active: ``sites`` maps
    ``(file:line, what)`` to the number of calls; ``seconds`` is their total time (the wait, on CUDA)."""

    def __init__(self, device="cpu"):
        self.device = device
        self.sites = {}
        self.seconds = 0.0
        self.cuda_syncs = None  # what torch.cuda.set_sync_debug_mode saw (CUDA only)
        self._patcher = Patcher()
        self._busy = False
        self._thread = None
        self._syncs = None

    def __enter__(self):
        self._thread = threading.get_ident()
        try:
            for name, what in HOST_READS.items():
                self._patcher.install(torch.Tensor, name, lambda original, what=what: self._wrap(original, what))
            self._syncs = contextlib.ExitStack()
            self.cuda_syncs = self._syncs.enter_context(count_syncs(self.device))  # untested: no CUDA here
        except BaseException:
            self._patcher.restore_all()
            raise
        return self

    def __exit__(self, *exc):
        try:
            self._syncs.close()
        finally:
            self._patcher.restore_all()
        return False

    def _wrap(self, original, what):
        def host_read(*args, **kwargs):
            if self._busy or threading.get_ident() != self._thread:
                return original(*args, **kwargs)  # a read inside a read (printing calls .tolist()), or a worker
            site = user_site(sys._getframe(1))
            self._busy = True
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._busy = False
                if site is not None:
                    self.seconds += time.perf_counter() - start
                    self.sites[(site, what)] = self.sites.get((site, what), 0) + 1
        host_read.__name__ = getattr(original, "__name__", what)
        host_read.__doc__ = getattr(original, "__doc__", None)
        return host_read


class CastTimer(CastCounter):
    """:class:`~amp_patch.tools.experiment.variants.CastCounter` that counts only dtype changes and times them;
    it also records the half-precision matmuls the user's code calls whose sizes are not multiples of 8:
    ``matmuls`` maps ``(file:line, k, n)`` to seconds (``mm``/``bmm``/``addmm``/``baddbmm``: ``k`` the
    contracted size, ``n`` the output's last; the backward's, called by autograd, have no user line)."""

    def __init__(self, params=(), cuda=False, modules=None):
        super().__init__(params)
        self.seconds = 0.0
        self.matmuls = {}
        self.matmul_calls = {}  # the same keys -> calls
        self.matmul_shapes = {}  # the same keys -> (a's shape, b's shape, dtype)
        self._cuda = cuda
        self._names = modules or {}  # id(module) -> its name in the model
        self._stack = []
        self._hooks = []

    def __enter__(self):
        from torch.nn.modules import module as nn_module
        self._hooks = [nn_module.register_module_forward_pre_hook(self._enter_module),
                       nn_module.register_module_forward_hook(self._leave_module)]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []

    def _enter_module(self, module, args):
        self._stack.append(self._names.get(id(module)))

    def _leave_module(self, module, args, output):
        if self._stack:
            self._stack.pop()

    def _running_module(self):
        return next((name for name in reversed(self._stack) if name is not None), None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            return self._matmul(func, args, kwargs)
        if func is not _TO_COPY or not args or kwargs.get("dtype") in (None, getattr(args[0], "dtype", None)):
            return func(*args, **kwargs)
        out, seconds = self._timed(lambda: super(CastTimer, self).__torch_dispatch__(func, types, args, kwargs))
        self.seconds += seconds
        return out

    def _timed(self, run):
        if self._cuda:  # untested: no CUDA on the machine this was written on
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = run()
        if self._cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    def _matmul(self, func, args, kwargs):
        a, b = args[_MATMULS[func]:_MATMULS[func] + 2]
        k, n = a.shape[-1], b.shape[-1]
        if a.dtype not in (torch.float16, torch.bfloat16) or not (k % 8 or n % 8):
            return func(*args, **kwargs)
        site = user_site(sys._getframe(2), through_amp_patch=True, libraries=True)  # (1 is __torch_dispatch__)
        if site is not None and site.startswith(_LIBRARIES):  # inside a library (transformers): the user's module
            site = f"module {self._running_module() or 'model'}"
        if site is None:
            return func(*args, **kwargs)
        out, seconds = self._timed(lambda: func(*args, **kwargs))
        key = (site, k, n)
        self.matmuls[key] = self.matmuls.get(key, 0.0) + seconds
        self.matmul_calls[key] = self.matmul_calls.get(key, 0) + 1
        self.matmul_shapes.setdefault(key, (tuple(a.shape), tuple(b.shape), a.dtype))
        return out


class ModuleTimer:
    """Total forward seconds of each module in ``modules`` ({name: module}) while active: ``seconds[name]``."""

    def __init__(self, modules, cuda=False):
        self.modules = modules
        self.seconds = dict.fromkeys(modules, 0.0)
        self.calls = dict.fromkeys(modules, 0)
        self.inputs = {}  # name -> (shape, dtype) of its first input
        self._cuda = cuda
        self._handles = []
        self._started = {}

    def __enter__(self):
        try:
            for name, module in self.modules.items():
                self._handles.append(module.register_forward_pre_hook(self._pre(name)))
                self._handles.append(module.register_forward_hook(self._post(name)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False

    def _sync(self):
        if self._cuda:  # untested: no CUDA on the machine this was written on
            torch.cuda.synchronize()

    def _pre(self, name):
        def pre(module, args):
            self.calls[name] += 1
            if args and torch.is_tensor(args[0]):
                self.inputs.setdefault(name, (tuple(args[0].shape), args[0].dtype))
            self._sync()
            self._started.setdefault(name, []).append(time.perf_counter())
        return pre

    def _post(self, name):
        def post(module, args, output):
            self._sync()
            self.seconds[name] += time.perf_counter() - self._started[name].pop()
        return post
