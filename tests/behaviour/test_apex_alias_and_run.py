"""Legacy drop-in: the apex alias, `amp-patch run`, the old handle API and the unmodified Apex example scripts."""
import argparse
import importlib
import io
import math
import os
import re
import sys

import pytest
import torch
from tests_support import REPO, TESTS, run_killing_group

import amp_patch
from amp_patch import legacy
from amp_patch.legacy import ApexAttributeError, ApexFeatureError, ApexImportError

ROOT = str(REPO)
EXAMPLES = os.path.join(ROOT, "examples", "legacy")
IMAGENET = os.path.join(EXAMPLES, "imagenet_amp.py")
DCGAN = os.path.join(EXAMPLES, "dcgan_amp.py")
DDP = os.path.join(EXAMPLES, "ddp_amp.py")
HERE = str(TESTS)

# The first torch.save in a process caches copyreg's Tensor.__slotnames__, which the autouse leak check of
# conftest.py would report as a patch; pay that one-off cost at import.
torch.save(torch.zeros(1), io.BytesIO())


def _apex_modules():
    return {n: m for n, m in sys.modules.items() if n == "apex" or n.startswith("apex.")}


@pytest.fixture(autouse=True)
def no_alias_leak():
    """Every test leaves sys.meta_path and the apex entries of sys.modules as it found them."""
    meta_path, modules = list(sys.meta_path), _apex_modules()
    yield
    leaked = legacy.apex_alias_installed()
    legacy.uninstall_apex_alias()
    for name in set(_apex_modules()) - set(modules):
        del sys.modules[name]
    sys.modules.update(modules)
    assert not leaked, "the apex alias was left installed"
    assert sys.meta_path == meta_path


@pytest.fixture
def fake_apex(tmp_path, monkeypatch):
    """A minimal real `apex` package (no amp) on sys.path; returns its directory."""
    pkg = tmp_path / "apex"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL_APEX = True\n")
    (pkg / "other.py").write_text("def fused_thing():\n    return 'real apex.other'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return pkg


# -- the alias ----------------------------------------------------------------------------------------------
def test_every_import_form_resolves_to_amp_patch():
    meta_path, modules = list(sys.meta_path), _apex_modules()
    with pytest.raises(ImportError):
        importlib.import_module("apex")
    handle = legacy.install_apex_alias()
    import apex
    import apex.amp as amp_as
    from apex import amp
    from apex.amp import init, load_state_dict, master_params, scale_loss, state_dict
    assert amp is amp_as is apex.amp
    assert scale_loss is amp_patch.scale_loss and master_params is legacy.amp_state.master_params  # Apex's loop
    assert state_dict is amp_patch.state_dict and load_state_dict is legacy.apex_amp.load_state_dict  # (Apex's
    assert amp.initialize is legacy.apex_amp.initialize and init is legacy.handle.init  # unexpected-key order)
    for name in ("half_function", "float_function", "promote_function", "disable_casts"):
        assert getattr(amp, name) is getattr(amp_patch, name), name
    for name in ("register_half_function", "register_float_function", "register_promote_function"):
        assert getattr(amp, name) is getattr(legacy.registrations, name), name  # (Apex's: after initialize too)
    assert legacy.amp.scale_loss is amp.scale_loss  # the one-import-line migration gives the same API
    handle.uninstall()
    assert sys.meta_path == meta_path and _apex_modules() == modules
    with pytest.raises(ImportError):
        importlib.import_module("apex")


def test_nested_installs_share_one_alias_and_uninstall_all_removes_it():
    meta_path = list(sys.meta_path)
    outer = legacy.install_apex_alias()
    with legacy.install_apex_alias() as inner:
        assert inner is outer
    assert legacy.apex_alias_installed()
    importlib.import_module("apex.amp")
    legacy.install_apex_alias()
    legacy.uninstall_apex_alias()
    assert not legacy.apex_alias_installed() and sys.meta_path == meta_path and not _apex_modules()


def test_real_apex_without_amp_keeps_working_and_gets_our_amp(fake_apex):
    with legacy.install_apex_alias():
        import apex
        import apex.other
        from apex import amp
        assert apex.REAL_APEX and apex.other.fused_thing() == "real apex.other"
        assert amp.scale_loss is amp_patch.scale_loss and apex.amp is amp
        assert apex.__spec__.origin == str(fake_apex / "__init__.py")
        with pytest.raises(ImportError, match="apex.amp.rnn_compat"):
            importlib.import_module("apex.amp.rnn_compat")
    assert "apex" not in sys.modules and not hasattr(importlib.import_module("apex"), "amp")
    with pytest.raises(ImportError):
        importlib.import_module("apex.amp")
    assert importlib.import_module("apex.other").fused_thing() == "real apex.other"


def test_already_imported_real_apex_gets_amp_attribute_until_uninstall(fake_apex):
    apex = importlib.import_module("apex")
    with legacy.install_apex_alias():
        assert apex.amp.initialize is legacy.apex_amp.initialize  # `import apex; apex.amp.initialize(...)` works
    assert not hasattr(apex, "amp") and sys.modules["apex"] is apex


def test_real_apex_amp_is_refused_unless_forced(fake_apex):
    (fake_apex / "amp.py").write_text("REAL_AMP = True\n")
    importlib.invalidate_caches()
    with pytest.raises(amp_patch.UsageError, match=r"real apex\.amp is installed.*force=True"):
        legacy.install_apex_alias()
    assert not legacy.apex_alias_installed()
    with legacy.install_apex_alias(force=True):
        from apex import amp
        assert amp.initialize is legacy.apex_amp.initialize
    from apex import amp
    assert amp.REAL_AMP


def test_forced_alias_restores_an_imported_real_amp(fake_apex):
    (fake_apex / "amp.py").write_text("REAL_AMP = True\n")
    importlib.invalidate_caches()
    import apex.amp
    real = apex.amp
    with legacy.install_apex_alias(force=True):
        assert importlib.import_module("apex.amp") is not real and apex.amp is not real
    assert sys.modules["apex.amp"] is real and apex.amp is real


# -- unsupported features -----------------------------------------------------------------------------------
UNSUPPORTED_ATTRS = [
    ("amp.scaler", "LossScaler", "loss_scale"),
    ("amp.utils", "apex.amp.utils (an Apex-internal module)", "amp.initialize"),
    ("amp.frontend", "apex.amp.frontend", "amp.initialize"),
    ("amp.no_such_thing", "no_such_thing", "amp.initialize"),
    ("apex.contrib", "apex.contrib", "NVIDIA apex itself"),
    ("apex.mlp", "apex.mlp", "torch.nn.Linear"),
]


@pytest.mark.parametrize("expr,feature,alternative", UNSUPPORTED_ATTRS)
def test_unsupported_attribute_names_feature_and_alternative(expr, feature, alternative):
    with legacy.install_apex_alias():
        import apex
        from apex import amp
        with pytest.raises(ApexAttributeError) as info:
            eval(expr, {"apex": apex, "amp": amp})
    assert isinstance(info.value, AttributeError) and isinstance(info.value, amp_patch.AmpPatchError)
    assert feature in str(info.value) and alternative in str(info.value)
    assert not hasattr(legacy.amp, "scaler")  # hasattr still answers (AttributeError subclass)


UNSUPPORTED_IMPORTS = [
    ("from apex.contrib.optimizers import FusedLAMB", "apex.contrib", "NVIDIA apex itself"),
    ("from apex.transformer import tensor_parallel", "apex.transformer", "torch.distributed.tensor.parallel"),
    ("import apex.pyprof", "apex.pyprof", "torch.profiler"),
    ("from apex.amp import scaler", "LossScaler", "amp.state_dict()"),
    ("from apex.amp import rnn_compat", "rnn_compat", "op lists"),
]


@pytest.mark.parametrize("stmt,feature,alternative", UNSUPPORTED_IMPORTS)
def test_unsupported_import_names_feature_and_alternative(stmt, feature, alternative):
    with legacy.install_apex_alias():
        with pytest.raises(ApexImportError) as info:
            exec(stmt, {})
    assert isinstance(info.value, ImportError) and isinstance(info.value, ApexFeatureError)
    assert feature in str(info.value) and alternative in str(info.value)


def test_script_using_apex_internals_fails_with_the_alternative(capsys):
    with pytest.raises(ApexImportError, match=r"apex\.amp\.scaler.*amp\.state_dict\(\)"):
        legacy.run_script(os.path.join(HERE, "_legacy_unsupported_script.py"))
    assert "loss scale 65536.0" in capsys.readouterr().out  # _amp_state (provided) was read before that
    assert amp_patch.session.state.current() is None and not legacy.apex_alias_installed()


# -- the runner and the CLI ---------------------------------------------------------------------------------
def _run(script, *args, capsys):
    status = legacy.run_script(script, [str(a) for a in args])
    out = capsys.readouterr().out
    assert status == 0, out
    assert amp_patch.session.state.current() is None and not legacy.apex_alias_installed()
    return out


def _losses(out, pattern=r"\bloss (\d+\.\d+)"):
    return [float(v) for v in re.findall(pattern, out)]


def test_run_parser_passes_script_options_through(tmp_path):
    parser = argparse.ArgumentParser()
    legacy.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run", "train.py", "--opt-level", "O2", "--force", "-h"])
    assert (args.target, args.args, args.force, args.module) == ("train.py", ["--opt-level", "O2", "--force", "-h"],
                                                                 False, False)
    args = parser.parse_args(["run", "--force", "-m", "pkg.train", "x"])
    assert (args.target, args.args, args.force, args.module) == ("pkg.train", ["x"], True, True)
    script = tmp_path / "exits.py"
    script.write_text("import sys\nfrom apex import amp\nassert sys.argv == [__file__, 'a']\nsys.exit(3)\n")
    argv, path = list(sys.argv), list(sys.path)
    assert args.func(parser.parse_args(["run", str(script), "a"])) == 3
    assert sys.argv == argv and sys.path == path


def test_run_module_like_python_m(tmp_path, monkeypatch, capsys):
    (tmp_path / "legacy_mod_train.py").write_text(
        "import sys\nimport apex.amp as amp\nprint('module run', __name__, sys.argv[1:], amp.init.__module__)\n")
    monkeypatch.chdir(tmp_path)
    assert legacy.run_script("legacy_mod_train", ["--x", "1"], module=True) == 0
    assert "module run __main__ ['--x', '1'] amp_patch.legacy.handle" in capsys.readouterr().out
    sys.modules.pop("legacy_mod_train", None)


def test_runner_deinitializes_when_the_script_raises(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import torch\nfrom apex import amp\n"
                      "m, o = amp.initialize(torch.nn.Linear(2, 2), torch.optim.SGD([torch.nn.Parameter("
                      "torch.ones(1))], lr=1), opt_level='O1')\nraise KeyError('boom')\n")
    with pytest.raises(KeyError, match="boom"):
        legacy.run_script(str(script))
    assert amp_patch.session.state.current() is None and not legacy.apex_alias_installed()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_imagenet_example_learns_and_resumes_from_its_checkpoint(level, tmp_path, capsys):
    ckpt = tmp_path / "ckpt.pt"
    full = _losses(_run(IMAGENET, "--opt-level", level, "--steps", 8, capsys=capsys))
    assert len(full) == 8 and max(full[-2:]) < min(full[:2])
    first = _losses(_run(IMAGENET, "--opt-level", level, "--steps", 5, "--checkpoint", ckpt, capsys=capsys))
    saved = torch.load(ckpt)
    assert saved["step"] == 5 and set(saved["amp"]) >= {"loss_scaler0"}
    out = _run(IMAGENET, "--opt-level", level, "--steps", 8, "--checkpoint", ckpt, "--resume", capsys=capsys)
    assert "resumed" in out and "step 6 " in out and "step 5 " not in out
    resumed = _losses(out)
    assert first == full[:5]
    assert resumed == pytest.approx(full[5:], abs=2e-6)  # continues exactly where the uninterrupted run was


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gan_example_three_losses_two_optimizers(level, capsys):
    out = _run(DCGAN, "--opt_level", level, "--niter", 10, capsys=capsys)
    loss_d = _losses(out, r"Loss_D: (\d+\.\d+)")
    assert len(loss_d) == 10 and loss_d[-1] < loss_d[0] - 0.2
    loss_g = _losses(out, r"Loss_G: (\S+)")  # \S+: a nan or inf must be read, not skipped
    assert len(loss_g) == 10 and all(math.isfinite(v) for v in loss_g), loss_g


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_example_single_process(level, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    losses = _losses(_run(DDP, "--opt-level", level, "--steps", 8, capsys=capsys))
    assert len(losses) == 8 and losses[-1] < losses[0] / 2


def _module_cli():
    """`python -m amp_patch run` once amp_patch/__main__.py exists, else this package's own entry point."""
    if importlib.util.find_spec("amp_patch.__main__") is not None:
        return "amp_patch"
    return "amp_patch.legacy"


def test_subprocess_python_m_run(tmp_path):
    cmd = [sys.executable, "-m", _module_cli(), "run", IMAGENET, "--opt-level", "O2", "--steps", "4"]
    proc = run_killing_group(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr
    losses = _losses(proc.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_example_under_torchrun_two_ranks(level, tmp_path):
    # --standalone: a free rendezvous port, so concurrent runs on one machine do not collide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", _module_cli(), "run", DDP, "--opt-level", level, "--steps", "6"]
    proc = run_killing_group(cmd, tmp_path, dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = _losses(proc.stdout)
    assert len(losses) == 6 and losses[-1] < losses[0]
    checksums = dict(re.findall(r"rank (\d) checksum (-?\d+\.\d+)", proc.stdout))
    assert set(checksums) == {"0", "1"} and checksums["0"] == checksums["1"]


# -- the old handle API -------------------------------------------------------------------------------------
def test_handle_api_script(capsys):
    out = _run(os.path.join(HERE, "_legacy_handle_script.py"), capsys=capsys)
    assert "out_dtype torch.float16" in out and "active_after_deactivate False" in out
    assert "step 3 loss" in out and re.search(r"step 3 loss \S+ unchanged True", out)
    losses = _losses(out)
    assert losses[-1] < losses[0] / 2


def test_handle_api_disabled_passes_through(capsys):
    out = _run(os.path.join(HERE, "_legacy_handle_script.py"), "--disabled", capsys=capsys)
    assert "out_dtype torch.float32" in out and "unchanged True" not in out


def test_handle_scale_loss_and_misuse():
    handle = legacy.amp.init(loss_scale=128.0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(amp_patch.UsageError, match="already initialized"):
        legacy.amp.init()
    with handle.scale_loss(model(torch.ones(2, 3)).float().sum(), optimizer) as scaled:
        assert scaled.item() == pytest.approx(128.0 * model(torch.ones(2, 3)).float().sum().item(), rel=1e-2)
        scaled.backward()
    assert model.weight.grad.abs().max() == pytest.approx(2.0, rel=1e-3)  # unscaled on exit
    assert legacy.amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0
    wrapped = handle.wrap_optimizer(optimizer)
    assert wrapped.param_groups is optimizer.param_groups and wrapped.state_dict() == optimizer.state_dict()
    with wrapped.scale_loss(model(torch.ones(1, 3)).float().sum()) as scaled:
        scaled.backward()
    with pytest.raises(amp_patch.UsageError, match="num_loss=2"):
        with wrapped.scale_loss(model(torch.ones(1, 3)).float().sum()):
            pass
    with pytest.raises(amp_patch.UsageError, match="closure"):
        wrapped.step(lambda: 0.0)
    assert handle._default_scaler.loss_scale() == 128.0  # Apex's handle scaler is the session's scaler 0
    handle._deactivate()
    assert not handle.is_active() and amp_patch.session.state.current() is None


def test_wrapped_optimizer_step_after_an_overflow_prints_apex_line(capsys):
    handle = legacy.amp.init()
    model = torch.nn.Linear(3, 1)
    wrapped = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    try:
        for inf in (True, False):
            with wrapped.scale_loss(model(torch.ones(1, 3)).float().sum() * (float("inf") if inf else 1.0)) as scaled:
                scaled.backward()
            capsys.readouterr()
            wrapped.step()
            wrapped.zero_grad()
            out = capsys.readouterr().out
            assert out == ("Gradient overflow, skipping update\n" if inf else "")
            assert torch.equal(model.weight, before) == inf
    finally:
        handle._deactivate()


def _fold_step(model, optimizer, x):
    with legacy.amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_apex_initialize_again_adds_to_the_open_session_as_apex_did(caplog):
    """k-fold loops call amp.initialize once per fold and the HF Trainer once per train(), never deinitializing:
    as in Apex, the earlier folds' models and optimizers stay initialized and can keep training."""
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    folds = []
    for fold in range(3):
        torch.manual_seed(fold)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with caplog.at_level("WARNING", logger="amp_patch"):
            model, optimizer = legacy.amp.initialize(model, optimizer, opt_level="O2", verbosity=0, loss_scale=128.0)
        _fold_step(model, optimizer, x)
        folds.append((model, [p.detach().clone() for p in legacy.amp.master_params(optimizer)], optimizer))
    assert "WARNING" not in caplog.text
    for model, masters, optimizer in folds:  # every fold still O2, its masters as its own steps left them
        assert all(p.dtype is torch.float16 for p in model.parameters())
        assert all(torch.equal(p, m) for p, m in zip(legacy.amp.master_params(optimizer), masters))
    _fold_step(folds[0][0], folds[0][2], x)  # an earlier fold's optimizer still trains
    folds[-1] = folds[-1][:2]

    model, _ = folds[-1]  # the Trainer's second train(): the same model and a new optimizer continue from the masters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = legacy.amp.initialize(model, optimizer, opt_level="O2", verbosity=0, loss_scale=128.0)
    assert all(torch.equal(m, t) for m, t in zip(legacy.amp.master_params(optimizer), folds[-1][1]))
    _fold_step(model, optimizer, x)
    amp_patch.deinitialize()
    with pytest.raises(amp_patch.UsageError, match="already called.*deinitialize"):  # the core API still refuses
        amp_patch.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
        amp_patch.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
    amp_patch.deinitialize()
