"""amp_patch.integrations.lightning: the Trainer and Fabric precision plugins, against Lightning 2.6 itself.

Tiny models, a few steps each (a Trainer's start-up costs about a second here). References are the same runs
without the plugin (fp32), with the tolerances stated at each comparison.
"""
import gc
import math
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from tests_support import REPO

L = pytest.importorskip("lightning")  # imported before the leak fixture's snapshot (it touches torch on import)
from tests_support import run_killing_group  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import amp_patch  # noqa: E402
from amp_patch.integrations.lightning import AmpPatchFabricPrecision, AmpPatchPrecision  # noqa: E402

ORIGINAL_LINEAR = F.linear
# fp16 runs start at a loss scale of 2**12: at the default 2**16 the first step of these models overflows (a
# normal, skipped first step that would shift every trajectory by one step against the fp32 reference).
FP16 = dict(max_loss_scale=2.0 ** 12)
ROOT = str(REPO)

_gen = torch.Generator().manual_seed(0)
X = torch.randn(64, 8, generator=_gen)
Y = X @ torch.randn(8, 1, generator=_gen)


def trainer(tmp_path, plugin=None, **kwargs):
    options = dict(accelerator="cpu", devices=1, max_steps=16, logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                   default_root_dir=tmp_path)
    options.update(kwargs)
    return L.Trainer(plugins=[plugin] if plugin is not None else None, **options)


class Tiny(L.LightningModule):
    """Linear-ReLU-Linear regression; records losses, activation dtypes, skips and scales per step."""

    def __init__(self, inject=(), lr=0.05, momentum=0.9):
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.inject, self.lr, self.momentum = set(inject), lr, momentum
        self.losses, self.dtypes, self.param_dtypes, self.steps = [], set(), set(), []
        self.net[0].register_forward_hook(lambda m, a, out: self.dtypes.add(out.dtype))
        # the weight the forward runs on (O2: a half compute copy of the fp32 param, inside the call only)
        self.net[0].register_forward_pre_hook(lambda m, a: self.param_dtypes.add(m.weight.dtype))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss * math.inf if batch_idx in self.inject else loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x).float(), y.float()))

    def val_dataloader(self):
        return DataLoader(TensorDataset(X[:16], Y[:16]), batch_size=8)

    def on_train_batch_start(self, batch, batch_idx):  # main_params: the fp32 masters under the plugin
        self.before = [p.detach().clone() for p in self.trainer.precision_plugin.main_params(self.optimizers())]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        opt = self.trainer.optimizers[0]
        after = list(self.trainer.precision_plugin.main_params(opt))
        moved = math.sqrt(sum(float((a - b).double().pow(2).sum()) for a, b in zip(after, self.before)))
        if isinstance(self.trainer.precision_plugin, AmpPatchPrecision):
            self.steps.append((batch_idx, amp_patch.last_step_skipped(opt), amp_patch.loss_scale(), moved))
        else:
            self.steps.append((batch_idx, False, 1.0, moved))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=8)


def fit(tmp_path, plugin=None, module=None, **kwargs):
    module = module if module is not None else Tiny()
    trainer(tmp_path, plugin, **kwargs).fit(module)
    return module


def assert_torn_down(module, opt):
    assert F.linear is ORIGINAL_LINEAR
    with pytest.raises(amp_patch.UsageError):
        amp_patch.loss_scale()
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert opt.param_groups[0]["params"][0] is module.net[0].weight


CASES = {  # id: (plugin keywords, trainer keywords, half dtype, tolerance on the final loss vs fp32)
    "O1-fp16": (dict(opt_level="O1", **FP16), {}, torch.float16, 0.05),
    "O2-bf16": (dict(opt_level="O2", half_dtype=torch.bfloat16), {}, torch.bfloat16, 0.10),
    "O2-fp16-clip-accum": (dict(opt_level="O2", **FP16), dict(gradient_clip_val=0.5, accumulate_grad_batches=2),
                           torch.float16, 0.05),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """fp32 runs (no plugin) for the two trainer configurations."""
    path = tmp_path_factory.mktemp("ref")
    return {key: fit(path, **kw) for key, kw in
            {"plain": {}, "clip-accum": CASES["O2-fp16-clip-accum"][1]}.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_learns_in_half_and_tears_down(tmp_path, references, case):
    plugin_kw, trainer_kw, half, rtol = CASES[case]
    tr = trainer(tmp_path, AmpPatchPrecision(**plugin_kw), **trainer_kw)
    module = Tiny()
    tr.fit(module)
    ref = references["clip-accum" if trainer_kw else "plain"]
    assert module.dtypes == {half}  # activations in the half dtype
    assert module.param_dtypes == ({torch.float32} if plugin_kw["opt_level"] == "O1" else {half})
    final, ref_final = sum(module.losses[-4:]) / 4, sum(ref.losses[-4:]) / 4
    assert final < 0.4 * module.losses[0]  # learns (a noisy momentum run: fp32 gets 0.25x in 16 steps)
    assert final == pytest.approx(ref_final, rel=rtol, abs=2e-3)  # and follows the fp32 run
    assert not any(skipped for _, skipped, _, _ in module.steps)
    val = float(tr.callback_metrics["val_loss"])  # validation (logging included) ran under the plugin too
    assert val == pytest.approx(float(ref.trainer.callback_metrics["val_loss"]), rel=rtol, abs=2e-3)
    assert_torn_down(module, tr.optimizers[0])


def test_trainer_weights_follow_fp32_with_accumulation_and_clipping(tmp_path, references):
    """O2 fp16 masters after 8 accumulated, clipped steps: within 1e-2 of the fp32 run's weights (a dropped
    micro-batch or clipping the scaled grads moves them by > 5e-2)."""
    module = fit(tmp_path, AmpPatchPrecision("O2", **FP16), **CASES["O2-fp16-clip-accum"][1])
    ref = references["clip-accum"]
    for p, q in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-2, rtol=0)


def test_trainer_overflow_skips_that_step_and_backs_off(tmp_path):
    module = fit(tmp_path, AmpPatchPrecision("O2", **FP16), module=Tiny(inject={3}), max_steps=6)
    skipped = [s for _, s, _, _ in module.steps]
    assert skipped == [False, False, False, True, False, False]
    assert [scale for _, _, scale, _ in module.steps] == [2.0 ** 12] * 3 + [2.0 ** 11] * 3
    assert module.steps[3][3] == 0.0 and all(moved > 0 for _, _, _, moved in module.steps[4:])


def test_trainer_clips_the_unscaled_master_grads(tmp_path):
    """Plain SGD with gradient_clip_val=0.01 (the raw norm is ~10): each update has norm lr * 0.01 exactly.
    Clipping the scaled grads would move 2**12 times less; clipping the half model grads would not clip."""
    module = fit(tmp_path, AmpPatchPrecision("O2", **FP16), module=Tiny(lr=0.1, momentum=0.0), max_steps=4,
                 gradient_clip_val=0.01)
    for _, _, _, moved in module.steps:
        assert moved == pytest.approx(0.1 * 0.01, rel=2e-3)


class Gan(L.LightningModule):
    """Manual optimization with two optimizers (Lightning's GAN pattern with toggle_optimizer)."""

    def __init__(self, inject_d=()):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(2)
        self.gen = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        self.disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.inject_d = set(inject_d)
        self.log_g, self.log_d, self.skips = [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        loss_g = F.mse_loss(self.gen(x).float(), x.float())
        self.manual_backward(loss_g)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        loss_d = F.mse_loss(self.disc(self.gen(x).detach()).float(), y.float())
        self.manual_backward(loss_d * math.inf if batch_idx in self.inject_d else loss_d)
        self.clip_gradients(opt_d, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_g.append(loss_g.item())
        self.log_d.append(loss_d.item())
        self.skips.append((amp_patch.last_step_skipped(opt_g.optimizer), amp_patch.last_step_skipped(opt_d.optimizer)))

    def configure_optimizers(self):
        return (torch.optim.Adam(self.gen.parameters(), lr=1e-2), torch.optim.Adam(self.disc.parameters(), lr=1e-2))

    def train_dataloader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=8)


def test_trainer_manual_optimization_two_optimizers(tmp_path):
    module = Gan(inject_d={2})
    tr = trainer(tmp_path, AmpPatchPrecision("O1", **FP16), max_epochs=3, max_steps=-1)
    tr.fit(module)
    # the discriminator's overflow (batch 2 of each of the 3 epochs) skips its step only
    assert module.skips == [(False, i % 8 == 2) for i in range(24)]
    assert module.log_g[-1] < 0.5 * module.log_g[0] and module.log_d[-1] < 0.5 * module.log_d[0]
    assert F.linear is ORIGINAL_LINEAR


def test_checkpoint_holds_the_amp_state_and_resume_restores_the_scale(tmp_path):
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    first = Tiny(inject={1, 2})
    trainer(tmp_path, AmpPatchPrecision("O2", **FP16), max_steps=4, enable_checkpointing=True,
            callbacks=[ckpt_cb]).fit(first)
    path = tmp_path / "epoch=0-step=4.ckpt"
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["AmpPatchPrecision"]["loss_scaler0"]["loss_scale"] == 2.0 ** 10

    seen = {}

    class Resumed(Tiny):
        def on_train_start(self):
            seen["scale"] = amp_patch.loss_scale()
            seen["state"] = {k: v.clone() for k, v in self.state_dict().items()}

    resumed = Resumed()
    trainer(tmp_path, AmpPatchPrecision("O2", **FP16), max_steps=6).fit(resumed, ckpt_path=path)
    assert seen["scale"] == 2.0 ** 10
    for key, value in ckpt["state_dict"].items():  # the fp32 masters come back bit-exact
        assert seen["state"][key].dtype == torch.float32 and torch.equal(seen["state"][key], value), key
    assert [s for _, s, _, _ in resumed.steps] == [False, False]


def test_validate_under_o2_leaves_the_exact_weights(tmp_path):
    module = Tiny()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    tr = trainer(tmp_path, AmpPatchPrecision("O2"))
    (result,) = tr.validate(module)
    assert module.dtypes == {torch.float16}
    ref = trainer(tmp_path).validate(Tiny())[0]["val_loss"]
    assert result["val_loss"] == pytest.approx(ref, rel=1e-2)
    for key, value in module.state_dict().items():  # fp32 again, not the fp16-rounded values
        assert value.dtype == torch.float32 and torch.equal(value, before[key]), key
    assert F.linear is ORIGINAL_LINEAR


def test_an_exception_in_training_step_still_tears_down(tmp_path):
    class Failing(Tiny):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise KeyError("boom")
            return super().training_step(batch, batch_idx)

    module = Failing()
    tr = trainer(tmp_path, AmpPatchPrecision("O2", half_dtype=torch.bfloat16))
    with pytest.raises(KeyError, match="boom"):
        tr.fit(module)
    assert_torn_down(module, tr.optimizers[0])


def test_precision_flag_with_the_plugin_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"precision=16-mixed.*AmpPatchPrecision\(opt_level='O2'\).*Choose one"):
        trainer(tmp_path, AmpPatchPrecision("O2"), precision="16-mixed")
    with pytest.raises(ValueError, match=r"precision=bf16-mixed.*AmpPatchFabricPrecision.*Choose one"):
        L.Fabric(accelerator="cpu", precision="bf16-mixed", plugins=AmpPatchFabricPrecision())


def test_plugin_argument_and_strategy_errors():
    with pytest.raises(amp_patch.ConfigError, match="unknown amp_patch.initialize keyword.*'half_dtpye'.*half_dtype"):
        AmpPatchPrecision("O2", half_dtpye=torch.bfloat16)
    with pytest.raises(amp_patch.ConfigError, match="opt_level=2"):
        AmpPatchFabricPrecision(2)
    module = Tiny()
    module._trainer = types.SimpleNamespace(strategy=object())  # what LightningModule.trainer returns
    with pytest.raises(amp_patch.UsageError, match="single-device and DDP strategies; got object"):
        AmpPatchPrecision().convert_module(module)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=AmpPatchPrecision())  # the Trainer plugin in Fabric
    with pytest.raises(amp_patch.UsageError, match="Trainer plugin.*Sequential outside a Trainer.*AmpPatchFabric"):
        fabric.setup(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(amp_patch.UsageError, match="LBFGS"):
        AmpPatchPrecision().optimizer_step(lbfgs, None, lambda: 0.0)


def fabric_run(plugin, steps=6, inject=(), clip=None):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    losses, weights, skips = [], [], []
    for i in range(steps):
        x, y = X[8 * (i % 8):8 * (i % 8) + 8], Y[8 * (i % 8):8 * (i % 8) + 8]
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        if plugin is not None or i not in inject:  # the fp32 reference skips the injected batches
            fabric.backward(loss * math.inf if i in inject else loss)
            if clip is not None:
                fabric.clip_gradients(model, opt, max_norm=clip)  # error_if_nonfinite=True: no raise on a skip
            opt.step()
        losses.append(loss.item())
        weights.append(model.module[0].weight.detach().float().clone())
        skips.append(amp_patch.last_step_skipped(opt.optimizer) if plugin is not None else False)
    return fabric, model, opt, losses, weights, skips


def test_fabric_loop_learns_skips_clips_and_checkpoints(tmp_path):
    _, _, _, ref_losses, ref_weights, _ = fabric_run(None, steps=24, inject={3}, clip=1.0)
    plugin = AmpPatchFabricPrecision("O2", **FP16)
    fabric, model, opt, losses, weights, skips = fabric_run(plugin, steps=24, inject={3}, clip=1.0)
    assert skips == [i == 3 for i in range(24)]
    assert torch.equal(weights[3], weights[2])
    # the first step (optimizer attached at its first clip, grads of the first backward): as fp32, 1e-3
    torch.testing.assert_close(weights[0], ref_weights[0], atol=1e-3, rtol=0)
    assert sum(losses[-4:]) / 4 < 0.4 * losses[0]
    assert sum(losses[-4:]) / 4 == pytest.approx(sum(ref_losses[-4:]) / 4, rel=0.05, abs=2e-3)
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": opt, "amp": plugin})
    plugin.teardown()
    assert F.linear is ORIGINAL_LINEAR and model.module[0].weight.dtype == torch.float32

    restored = AmpPatchFabricPrecision("O2", **FP16)
    fabric2, model2, opt2, *_ = fabric_run(restored, steps=0)
    fabric2.load(tmp_path / "state.ckpt", {"model": model2, "optimizer": opt2, "amp": restored})
    assert amp_patch.loss_scale() == 2.0 ** 11
    saved = torch.load(tmp_path / "state.ckpt", weights_only=False)["model"]
    fabric2.clip_gradients(model2, opt2, max_norm=1.0)  # attaches the optimizer: the masters are made now
    masters = dict(zip([n for n, _ in model2.module.named_parameters()], restored.main_params(opt2.optimizer)))
    for name, value in saved.items():  # the loaded fp32 weights, not the initial ones nor their fp16 rounding
        assert value.dtype == torch.float32 and torch.equal(masters[name], value), name
    restored.teardown()


def test_fabric_first_backward_overflow_and_one_module_per_plugin():
    plugin = AmpPatchFabricPrecision("O1", **FP16)
    fabric, model, opt, losses, weights, skips = fabric_run(plugin, steps=2, inject={0})
    assert skips == [True, False] and amp_patch.loss_scale() == 2.0 ** 11
    with pytest.raises(amp_patch.UsageError, match="already set up with a model.*one torch.nn.Module"):
        fabric.setup(torch.nn.Linear(2, 2))
    plugin.teardown()


def test_import_amp_patch_does_not_import_lightning_and_a_missing_lightning_is_named(tmp_path):
    code = ("import sys; import amp_patch; assert 'lightning' not in sys.modules, 'imported';"
            "sys.modules['lightning'] = None\n"
            "try:\n    import amp_patch.integrations.lightning\n"
            "except amp_patch.AmpPatchError as e:\n    assert isinstance(e, ImportError); print(e)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = run_killing_group([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'amp_patch[lightning]'" in out.stdout


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("loop,level", [("trainer", "O1"), ("trainer", "O2"), ("fabric", "O2")])
def test_ddp_two_processes_stay_identical_with_an_inf_on_one_rank(tmp_path, loop, level):
    """strategy="ddp", 2 CPU processes (gloo), Trainer or Fabric loop: different initial weights per rank, 2
    micro-batches per step (the first in no_sync), an inf on rank 1 only in batch 2: both ranks skip step 1,
    back off the same way and end bit-identical (fp32 masters and half model)."""
    script = os.path.join(ROOT, "tests", "_lightning_ddp_script.py")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = run_killing_group([sys.executable, script, str(tmp_path), level, loop], cwd=tmp_path, env=env,
                            timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert not torch.equal(ranks[0]["init"]["net.0.weight" if loop == "trainer" else "0.weight"],
                           ranks[1]["init"]["net.0.weight" if loop == "trainer" else "0.weight"])
    for part in ("start", "end", "half") if loop == "trainer" else ("end", "half"):
        for key, value in ranks[0][part].items():
            assert torch.equal(value, ranks[1][part][key]), (part, key)
    end, half = (next(iter(ranks[0][part].values())) for part in ("end", "half"))
    assert end.dtype == torch.float32 and half.dtype == torch.float32  # (O2: the model's params are the masters)
    assert ranks[0]["records"] == ranks[1]["records"]
    steps = [(skipped, scale) for batch, skipped, scale in ranks[0]["records"] if batch % 2 == 1]
    assert steps == [(False, 2.0 ** 12), (True, 2.0 ** 11), (False, 2.0 ** 11), (False, 2.0 ** 11)]
    assert not torch.equal(end, next(iter(ranks[0]["init"].values())))
    for r in (0, 1):
        assert (tmp_path / f"after_fit{r}.txt").read_text() == "F.linear unpatched: True\n"


def test_accelerate_recipe_from_the_docs_runs_and_learns(tmp_path):
    """The Accelerate block of docs/integrations.md, as written, with accelerate 1.15 (fresh process: the
    Accelerator keeps process-wide state)."""
    pytest.importorskip("accelerate")
    text = open(os.path.join(ROOT, "docs", "integrations.md")).read()
    code = text.split("## Hugging Face Accelerate", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "accelerator.backward(scaled_loss)" in code and 'mixed_precision="no"' in code
    prefix = ("import torch\nLINEAR = torch.nn.functional.linear\nDTYPES = set()\n"
              "torch.nn.modules.module.register_module_forward_hook("
              "lambda m, i, o: DTYPES.add(str(o.dtype)) if isinstance(o, torch.Tensor) else None)\n")
    suffix = ("\nimport json\nprint(json.dumps({'first': losses[0], 'last': losses[-4:], 'dtypes': sorted(DTYPES), "
              "'unpatched': torch.nn.functional.linear is LINEAR, 'param': str(model.module[0].weight.dtype) "
              "if hasattr(model, 'module') else str(model[0].weight.dtype)}))\n")
    script = tmp_path / "recipe.py"
    script.write_text(prefix + code + suffix)
    out = run_killing_group([sys.executable, str(script)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT),
                            timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert "torch.float16" in result["dtypes"]  # O2 ran the layers in half
    assert result["unpatched"] and result["param"] == "torch.float32"  # deinitialize restored the model
    assert sum(result["last"]) / 4 < 0.4 * result["first"]


def test_fabric_two_optimizers_attached_at_different_scales():
    """One backward before any optimizer is known, then two steps; growth_interval=1 doubles the scale at the
    first step's check, so the second optimizer's grads (made at the old scale) must be brought to the new
    one before they are unscaled: its update equals plain SGD's within fp16 rounding (2x off otherwise)."""

    def run(plugin):
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
        torch.manual_seed(3)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 1, bias=False), "b": torch.nn.Linear(8, 1, bias=False)})
        opt_a = torch.optim.SGD(model["a"].parameters(), lr=0.1)
        opt_b = torch.optim.SGD(model["b"].parameters(), lr=0.1)
        before = model["b"].weight.detach().clone()
        model, opt_a, opt_b = fabric.setup(model, opt_a, opt_b)
        x, y = X[:8] * 1e-3, Y[:8] * 1e-3  # small grads: no overflow at the initial 2**16
        x = x.to(torch.float16) if plugin is not None else x
        loss = F.mse_loss(model.module["a"](x).float(), y) + F.mse_loss(model.module["b"](x).float(), y)
        fabric.backward(loss)
        opt_a.step()
        opt_b.step()
        after = list(plugin.main_params(opt_b.optimizer))[0] if plugin is not None else model.module["b"].weight
        return after.detach() - before  # (the fp32 master: the fp16 weight cannot hold a 3e-5 update)

    ref = run(None)
    plugin = AmpPatchFabricPrecision("O2", max_loss_scale=2.0 ** 20, growth_interval=1)
    amp_step = run(plugin)
    assert amp_patch.loss_scale() == 2.0 ** 18  # 2**16, doubled after each of the two checks
    plugin.teardown()
    torch.testing.assert_close(amp_step, ref, rtol=1e-2, atol=1e-7)  # updates are ~3e-5


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_fabric_backward_keeps_grads_scaled_inside_ddp_no_sync(tmp_path):
    """What Fabric does under DDP with fabric.no_backward_sync(model) and fabric.backward(loss, model=model)
    (1-rank gloo group, plugin methods called as Fabric calls them): O2 must leave the micro-batch grads scaled in
    the params for DDP to reduce, and unscale the sum at the synced backward."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "s"), 1),
                                         rank=0, world_size=1)
    plugin = AmpPatchFabricPrecision("O2", **FP16)
    ddp = None
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1, bias=False)
        ref = model.weight.detach().clone().requires_grad_()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plugin.convert_module(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        plugin.unscale_gradients(opt)  # Fabric's first clip_gradients: attaches the optimizer
        (master,) = plugin.main_params(opt)
        x, y = X[:8] * 0.1, Y[:8] * 0.1
        with ddp.no_sync():
            plugin.backward(F.mse_loss(ddp(x).float(), y), ddp)
        assert master is model.weight  # (O2: the fp32 param is the master)
        scaled = model.weight.grad.clone()  # still scaled, in the param
        plugin.backward(F.mse_loss(ddp(x).float(), y), ddp)
        (2 * F.mse_loss(x @ ref.t(), y)).backward()
        torch.testing.assert_close(master.grad, ref.grad, rtol=1e-2, atol=1e-4)  # the 2 micro-batches, unscaled
        assert scaled.norm() > 100 * master.grad.norm()  # (the first was left scaled by the loss scale)
    finally:
        plugin.teardown()
        del ddp  # DDP's reducer must go before its process group: freed after it, gloo's destructor can hang
        gc.collect()
        torch.distributed.destroy_process_group()
