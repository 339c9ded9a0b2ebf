"""torch.compile and O2's compute copies: graphs must see the module hooks that make them.

O2's half weights exist only inside model calls, made by forward hooks (``weights/compute_copies.py``). dynamo does
not guard on nn.Module hooks by default (``torch._dynamo.config.skip_nnmodule_hook_guards``), and it shares one
compiled graph between instances of a class. So a graph compiled without the hooks (the model before
``initialize``, or an fp32 instance of the same class compiled before or during the session) was served to the O2
model: fp32 compute, silently. While a session with compute copies is open, :class:`HookGuards` turns the hook
guards on and, at the start, drops the compiled code of the process (``reset_code_caches``: graphs compiled
before were built without hook guards), so every graph the O2 model runs was traced with its hooks. Undone at
``deinitialize`` (the flag's own value back; graphs traced meanwhile keep their guards and stay right).
"""
import sys

from ..patching import registry

SITE = "torch._dynamo.config.skip_nnmodule_hook_guards"


class HookGuards:
    """The one reversible change of dynamo's configuration; listed in the patch registry while it holds."""

    def __init__(self):
        self._config = None
        self._old = None

    def sites(self):
        return [SITE] if self._config is not None else []

    def install(self):
        config = _config()
        if config is None or not hasattr(config, "skip_nnmodule_hook_guards"):
            return self  # no dynamo, or a torch that guards hooks without being asked
        self._config, self._old = config, config.skip_nnmodule_hook_guards
        registry.register(self)  # recorded first: an interrupt after the write leaves nothing unrecorded
        config.skip_nnmodule_hook_guards = False
        if self._old:
            _drop_compiled_code()
        return self

    def restore(self):
        if self._config is not None:
            self._config.skip_nnmodule_hook_guards = self._old
            self._config = None
        registry.forget(self)


def _config():
    if "torch._dynamo" not in sys.modules:  # (amp_patch's casting layer imports it; a torch without it: None)
        try:
            import torch._dynamo.config as config
        except ImportError:
            return None
        return config
    return sys.modules["torch._dynamo"].config


def _drop_compiled_code():
    dynamo = sys.modules.get("torch._dynamo")
    reset = getattr(dynamo, "reset_code_caches", None)
    if reset is not None:
        reset()
