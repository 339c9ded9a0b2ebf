"""amp_patch as a Lightning precision plugin: ``Trainer(plugins=[AmpPatchPrecision("O2")])`` and
``Fabric(plugins=AmpPatchFabricPrecision("O1"))``. See docs/integrations.md.

Needs the ``lightning`` package (``pip install "amp_patch[lightning]"``); ``import amp_patch`` never imports
this module. Where each amp_patch step runs (Lightning 2.4-2.6 call order):

* Trainer: ``Strategy.setup`` calls ``precision.convert_module(model)`` (here ``initialize(model)``: the model
  is cast before the DDP strategy wraps it), moves the model, wraps it in DDP, runs ``configure_optimizers`` and
  then ``precision.connect(model, optimizers, ...)`` (here ``attach_optimizers``; under DDP the fp32 masters
  get rank 0's values). The checkpoint's amp state is loaded after that; ``Strategy.teardown`` calls
  ``precision.teardown()`` (here ``deinitialize``).
* Fabric: ``fabric.setup`` calls ``convert_module`` before wrapping; Fabric shows the plugin an optimizer only at
  its first ``step()`` or ``clip_gradients``, so a backward before that scales the loss and the optimizer is
  attached there with those grads (``attach_optimizers(unscale_loss_id=0)``). Fabric never calls teardown:
  call ``precision.teardown()`` (or ``amp_patch.deinitialize()``) when training is done.
"""
import inspect

import torch

try:
    from lightning.fabric.plugins.precision import Precision as _FabricPrecisionBase
    from lightning.pytorch import LightningModule
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision as _TrainerPrecisionBase
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning_utilities import apply_to_collection
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test without lightning on the path
    from ..errors import MissingDependencyError

    raise MissingDependencyError(
        "amp_patch.integrations.lightning needs the 'lightning' package (>= 2.4), "
        f"which could not be imported ({exc}); "
        "install it with: pip install 'amp_patch[lightning]'") from exc

import amp_patch

from .._torch import dist as distributed
from ..errors import ConfigError, UsageError
from ..session.master_sync import broadcast_master_params

__all__ = ["AmpPatchPrecision", "AmpPatchFabricPrecision"]

_NOT_KEYWORDS = ("models", "optimizers", "opt_level")
_DDP = torch.nn.parallel.DistributedDataParallel


def _check_keywords(kwargs):
    allowed = [n for n in inspect.signature(amp_patch.initialize).parameters if n not in _NOT_KEYWORDS]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown amp_patch.initialize keyword(s) {unknown}; the plugin passes models, optimizers "
                          f"and opt_level itself and accepts: {', '.join(allowed)}")


def _precision_name(opt_level, kwargs):
    """What ``trainer.precision`` reports (Lightning's names; used by its model summary)."""
    half = "bf16" if kwargs.get("half_dtype") is torch.bfloat16 else "16"
    return {"O0": "32-true", "O3": f"{half}-true"}.get(opt_level, f"{half}-mixed")


def _input_dtype(opt_level, kwargs):
    """The dtype O2/O3 cast the model to (its inputs follow), None when the model stays fp32."""
    if opt_level not in ("O2", "O3") or kwargs.get("enabled", True) is False:
        return None
    dtype = kwargs.get("cast_model_type") or kwargs.get("half_dtype") or torch.float16
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def _raw(optimizer):
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _trainable(optimizer):
    return any(p.requires_grad for g in optimizer.param_groups for p in g["params"])


class _AmpSession:
    """What both plugins share: one amp_patch session per fit/setup, its optimizers and its saved state."""

    def __init__(self, opt_level, kwargs):
        if not isinstance(opt_level, str):
            raise ConfigError(f"opt_level={opt_level!r}; pass one of 'O0', 'O1', 'O2', 'O3' as a string")
        _check_keywords(kwargs)
        self.opt_level = opt_level
        self.kwargs = dict(kwargs)
        self.active = False
        self.module = None
        self.optimizers = []  # raw torch optimizers attached to the session
        self.saved_state = None  # amp state loaded before setup, or kept over teardown
        self.unattached_scale = None  # scale of grads a backward left for optimizers not attached yet (Fabric)

    def start(self, module, owner):
        """``initialize(module)``; the loss scale of an earlier fit with this plugin (or a state loaded before
        setup) carries over."""
        if self.active:
            raise UsageError(f"{owner} was already set up with a model; one plugin drives one amp_patch session. "
                             "Put every model in one torch.nn.Module and set that up once (Fabric: "
                             "fabric.setup(container, opt1, opt2)), or call precision.teardown() first")
        amp_patch.initialize(module, opt_level=self.opt_level, **self.kwargs)
        self.active, self.module = True, module
        if self.saved_state:
            amp_patch.load_state_dict(self.saved_state)

    def attach(self, optimizers, unscale=False):
        new = [opt for opt in optimizers if not any(opt is known for known in self.optimizers)]
        if not new:
            return
        if unscale:
            self._rescale_unattached(new)
        amp_patch.attach_optimizers(new, unscale_loss_id=0 if unscale else None)
        self.optimizers.extend(new)
        if distributed.world_size() > 1 and self.kwargs.get("enabled", True):
            broadcast_master_params()  # DDP gave every rank rank 0's half params; masters follow

    def _rescale_unattached(self, optimizers):
        """Grads left by an earlier backward at another scale: bring them to the current one (powers of two)."""
        now = amp_patch.loss_scale()
        if self.unattached_scale in (None, now):
            return
        grads = [p.grad for opt in optimizers for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, now / self.unattached_scale)

    def backward_optimizers(self, optimizer=None):
        """The optimizer Lightning names, else every attached optimizer with trainable params (GAN toggling)."""
        if optimizer is not None:
            return [_raw(optimizer)]
        trainable = [opt for opt in self.optimizers if _trainable(opt)]
        return trainable or list(self.optimizers)

    def main_params(self, optimizer):
        """The fp32 params ``optimizer`` updates (masters under O2); none when an overflow skips its step (nothing
        to clip, and no inf norm for ``clip_grad_norm_(error_if_nonfinite=True)`` to raise on)."""
        optimizer = _raw(optimizer)
        if not self.active:
            return [p for g in optimizer.param_groups for p in g["params"]]
        return [] if amp_patch.next_step_skipped(optimizer) else list(amp_patch.master_params(optimizer))

    def state_dict(self):
        return amp_patch.state_dict() if self.active else dict(self.saved_state or {})

    def load_state_dict(self, state):
        if self.active:
            amp_patch.load_state_dict(state)
        else:  # Lightning may load before setup: applied by start()
            self.saved_state = dict(state)

    def stop(self):
        if not self.active:
            return
        self.saved_state = amp_patch.state_dict()  # a checkpoint written after fit still holds the amp state
        devices = {p.device for p in self.module.parameters()}
        self.active, self.optimizers, self.unattached_scale = False, [], None
        amp_patch.deinitialize()  # O2: the params get their masters' data back, on the masters' device
        if len(devices) == 1:  # the Trainer moved the model to the CPU before its teardown: keep it there
            self.module.to(devices.pop())
        self.module = None


def _trainer_strategy(module):
    if isinstance(module, LightningModule):
        try:
            return module.trainer.strategy
        except RuntimeError:  # not attached to a Trainer
            pass
    raise UsageError(f"AmpPatchPrecision is the lightning.Trainer plugin, but it was asked to set up a "
                     f"{type(module).__name__} outside a Trainer (lightning.Fabric?); use "
                     "Fabric(plugins=AmpPatchFabricPrecision(...)) with Fabric")


def _refuse_lbfgs(optimizer):
    if isinstance(_raw(optimizer), torch.optim.LBFGS):
        raise UsageError("amp_patch plugins cannot drive LBFGS: it re-evaluates its closure inside step(), after "
                         "amp_patch decided whether to skip the step. Use another optimizer, or drop the plugin")


class _SessionPlugin:
    """What both plugins do alike: hold one :class:`_AmpSession`, name it, and hand its state to Lightning.

    Listed before Lightning's ``Precision`` in the bases, so these methods replace that class's defaults.
    """

    _plugin_name = None  # the public class's name, for repr and error messages

    def __init__(self, opt_level="O1", **initialize_keywords):
        self._amp = _AmpSession(opt_level, initialize_keywords)
        self.precision = _precision_name(opt_level, initialize_keywords)

    def __repr__(self):
        return f"{self._plugin_name}(opt_level={self._amp.opt_level!r})"

    def teardown(self):
        self._amp.stop()

    def main_params(self, optimizer):
        return self._amp.main_params(optimizer)

    # -- checkpoints: Lightning stores this under checkpoint[<the plugin's class name>] -------------------------
    def state_dict(self):
        return self._amp.state_dict()

    def load_state_dict(self, state_dict):
        self._amp.load_state_dict(state_dict)


class AmpPatchPrecision(_SessionPlugin, _TrainerPrecisionBase):
    """amp_patch for ``lightning.Trainer(plugins=[AmpPatchPrecision(opt_level, **initialize_keywords)])``.

    ``initialize_keywords`` are those of ``amp_patch.initialize`` (``half_dtype``, ``loss_scale``,
    ``keep_batchnorm_fp32``, ``op_lists``, ...). Do not also pass ``precision=`` to the Trainer.
    """

    _plugin_name = "AmpPatchPrecision"

    # -- setup (Strategy.setup order: convert_module, DDP wrap, configure_optimizers, connect) ------------------
    def convert_module(self, module):
        strategy = _trainer_strategy(module)
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise UsageError(f"AmpPatchPrecision works with the single-device and DDP strategies; got "
                             f"{type(strategy).__name__}. Use strategy='auto' or 'ddp' (or 'ddp_spawn'), or "
                             "Lightning's own precision= flag with this strategy")
        self._amp.start(module, self._plugin_name)
        return module

    def connect(self, model, optimizers, lr_schedulers):
        self._amp.attach([_raw(opt) for opt in optimizers])
        return model, optimizers, lr_schedulers

    def convert_input(self, data):
        """O2/O3: the Trainer's loops pass each batch here; training_step often calls submodules (``self.net(x)``),
        not the LightningModule's forward whose hooks cast the inputs, so the batch's floating tensors are cast to
        the model's half dtype here (as Lightning's own "16-true" does)."""
        dtype = _input_dtype(self._amp.opt_level, self._amp.kwargs)
        if dtype is None:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    # -- backward and step ------------------------------------------------------------------------------------
    def backward(self, tensor, model, optimizer, *args, **kwargs):
        opts = self._amp.backward_optimizers(optimizer)
        wrapped = model.trainer.strategy.model
        ddp = wrapped if isinstance(wrapped, _DDP) else None
        delay = ddp is not None and not ddp.require_backward_grad_sync  # accumulating in no_sync: unscale later
        with amp_patch.scale_loss(tensor, opts, model=ddp, delay_unscale=delay) as scaled:
            model.backward(scaled, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """Run Lightning's closure (forward, backward, clipping hooks) *before* ``step()``, whose pre-hook decides
        whether an overflow skips the step; a closure run inside ``step()`` would come too late."""
        _refuse_lbfgs(optimizer)
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: Lightning skipped the backward, nothing to step
        return optimizer.step(**kwargs)


class AmpPatchFabricPrecision(_SessionPlugin, _FabricPrecisionBase):
    """amp_patch for ``lightning.Fabric(plugins=AmpPatchFabricPrecision(opt_level, **initialize_keywords))``.

    Set up one module (``fabric.setup(model, *optimizers)``); ``fabric.backward(loss)`` scales the loss,
    ``optimizer.step()`` is skipped after an overflow, ``fabric.clip_gradients`` clips the fp32 master grads.
    Save ``{"amp": precision}`` in ``fabric.save`` state to checkpoint the loss scale. Call
    ``precision.teardown()`` when done (Fabric does not).
    """

    _plugin_name = "AmpPatchFabricPrecision"

    def convert_module(self, module):
        self._amp.start(module, self._plugin_name)
        return module

    def backward(self, tensor, model, *args, **kwargs):
        if not self._amp.active:
            raise UsageError("fabric.backward() before fabric.setup(model, ...): set the model up first")
        opts = self._amp.backward_optimizers()
        self._amp.unattached_scale = amp_patch.loss_scale()
        if not opts:  # before the first step(): the optimizers are attached there, with these grads
            (tensor.float() * self._amp.unattached_scale).backward(*args, **kwargs)
            return
        ddp = model if isinstance(model, _DDP) else None  # fabric.backward(loss, model=model) passes DDP's module
        delay = ddp is not None and not ddp.require_backward_grad_sync  # inside fabric.no_backward_sync(model)
        with amp_patch.scale_loss(tensor, opts, model=ddp, delay_unscale=delay) as scaled:
            scaled.backward(*args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs):
        _refuse_lbfgs(optimizer)
        closure = kwargs.pop("closure", None)
        self._amp.attach([optimizer], unscale=closure is None)  # a closure's backward comes after attaching
        result = closure() if closure is not None else None  # before step(): see AmpPatchPrecision.optimizer_step
        out = optimizer.step(**kwargs)
        return result if closure is not None else out

    def unscale_gradients(self, optimizer):
        """Fabric's clip_gradients calls this first: grads are unscaled when scale_loss exits; a first-seen
        optimizer is attached here with the grads of the backward that came before."""
        self._amp.attach([optimizer], unscale=True)
