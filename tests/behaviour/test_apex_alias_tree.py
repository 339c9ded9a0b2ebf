"""The apex alias serves amp_patch's mirror of Apex's tree (apex.X, amp_C, apex_C), apex's package metadata,
apex.amp._amp_state, and Apex's semantics that Apex's own unit tests rely on.

The mirror mechanism is tested with a small stand-in mirror module put in sys.modules here, so these tests do
not depend on amp_patch's real apex.parallel / apex.optimizers (tests/integration/test_real_apex_scripts.py runs those).
"""
import importlib
import importlib.metadata
import io
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import legacy
from amp_patch.legacy import ApexAttributeError, ApexImportError

torch.save(torch.zeros(1), io.BytesIO())  # (copyreg's one-off __slotnames__ cache; see test_apex_alias_and_run.py)


def _alias_modules():
    return {n: m for n, m in sys.modules.items() if n in ("apex", "amp_C", "apex_C") or n.startswith("apex.")}


@pytest.fixture(autouse=True)
def no_alias_leak(monkeypatch):
    """Every test leaves sys.meta_path, the alias's sys.modules entries and Apex's process switch as it found them."""
    meta_path, modules = list(sys.meta_path), _alias_modules()
    yield
    leaked = legacy.apex_alias_installed()
    legacy.uninstall_apex_alias()
    for name in set(_alias_modules()) - set(modules):
        del sys.modules[name]
    sys.modules.update(modules)
    allow = amp_patch.session.state.allow_incoming_model_not_fp32()
    amp_patch.session.state.set_allow_incoming_model_not_fp32(False)
    assert not leaked, "the apex alias was left installed"
    assert sys.meta_path == meta_path
    assert not allow, "the test left _amp_state.allow_incoming_model_not_fp32 set"


class StandInDDP(torch.nn.Module):
    def __init__(self, module, delay_allreduce=False):
        super().__init__()
        self.module = module


@pytest.fixture
def mirror(monkeypatch):
    """Stand-ins for amp_patch.legacy.apex.parallel(.distributed) and amp_patch.legacy.amp_C (the real mirror
    modules, if imported before, are hidden for the test)."""
    for name in [n for n in sys.modules if n.startswith(("amp_patch.legacy.apex.", "amp_patch.legacy.amp_C",
                                                          "amp_patch.legacy.apex_C"))]:
        monkeypatch.delitem(sys.modules, name)

    def module(name, package=False, **names):
        mod = types.ModuleType(name)
        if package:
            mod.__path__ = []
        vars(mod).update(names)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    root = module("amp_patch.legacy.apex", package=True)
    parallel = module("amp_patch.legacy.apex.parallel", package=True, DistributedDataParallel=StandInDDP,
                      convert_syncbn_model=lambda m, process_group=None, channel_last=False: m,
                      __all__=["DistributedDataParallel", "convert_syncbn_model"])
    distributed = module("amp_patch.legacy.apex.parallel.distributed", flat_dist_call=lambda *a: "flat")
    parallel.distributed = distributed  # as the import system would set it
    amp_c = module("amp_patch.legacy.amp_C", multi_tensor_l2norm=lambda *a: "l2norm")
    monkeypatch.setitem(sys.modules, "amp_patch.legacy.apex_C", None)  # no apex_C in this stand-in
    return types.SimpleNamespace(root=root, parallel=parallel, distributed=distributed, amp_C=amp_c)


# -- serving the mirror -------------------------------------------------------------------------------------
def test_mirrored_modules_are_served_generically_and_removed_on_uninstall(mirror):
    spec_before = mirror.parallel.__spec__
    with legacy.install_apex_alias():
        import amp_C
        import apex
        import apex.parallel.distributed
        from apex import amp, parallel
        from apex.parallel import DistributedDataParallel as DDP
        from apex.parallel.distributed import flat_dist_call
        assert amp.initialize is legacy.apex_amp.initialize and parallel is apex.parallel
        assert DDP is StandInDDP and flat_dist_call() == "flat" and amp_C.multi_tensor_l2norm() == "l2norm"
        assert parallel is not mirror.parallel and parallel.__name__ == "apex.parallel"
        assert apex.parallel.distributed is sys.modules["apex.parallel.distributed"]
        with pytest.raises(ImportError):
            import apex_C  # noqa: F401  (the mirror has none)
    assert mirror.parallel.__name__ == "amp_patch.legacy.apex.parallel" and mirror.parallel.__spec__ is spec_before
    assert not _alias_modules()
    for name in ("apex.parallel", "amp_C"):
        with pytest.raises(ImportError):
            importlib.import_module(name)


def test_stub_apex_imports_mirrored_submodules_lazily(mirror):
    with legacy.install_apex_alias():
        import apex
        assert "apex.parallel" not in sys.modules
        assert apex.parallel.convert_syncbn_model(torch.nn.Linear(1, 1)).in_features == 1
        assert "apex.parallel" in sys.modules and hasattr(apex, "parallel") and not hasattr(apex, "contrib")
        exec("from apex.parallel import *", namespace := {})
        assert set(namespace) - {"__builtins__"} == {"DistributedDataParallel", "convert_syncbn_model"}


def test_names_the_mirror_lacks_raise_with_what_it_has(mirror):
    with legacy.install_apex_alias():
        import apex.parallel
        with pytest.raises(ApexAttributeError, match=r"apex\.parallel\.multiproc.*has: DistributedDataParallel, "
                                                     r"convert_syncbn_model"):
            apex.parallel.multiproc  # noqa: B018 - the attribute read is what raises
        with pytest.raises(ApexImportError, match=r"apex\.parallel\.multiproc \(amp_patch provides apex\.parallel"):
            importlib.import_module("apex.parallel.multiproc")
        assert not hasattr(apex.parallel, "SyncBatchNorm")
        mirror.parallel.SyncBatchNorm = torch.nn.SyncBatchNorm  # a name the mirror gains later is found too
        assert apex.parallel.SyncBatchNorm is torch.nn.SyncBatchNorm


@pytest.mark.parametrize("stmt,feature,alternative", [
    ("import apex.contrib.optimizers", "apex.contrib", "NVIDIA apex itself"),
    ("from apex.transformer import parallel_state", "apex.transformer", "Megatron-Core"),
    ("import apex.mlp", "apex.mlp", "torch.nn.Linear"),
    ("import apex.no_such_module", "apex.no_such_module", "NVIDIA apex itself"),
])
def test_unprovided_modules_keep_the_clear_import_error(mirror, stmt, feature, alternative):
    with legacy.install_apex_alias():
        with pytest.raises(ApexImportError) as info:
            exec(stmt, {})
    assert feature in str(info.value) and alternative in str(info.value)


def test_a_module_the_mirror_lacks_gets_the_table_alternative(monkeypatch):
    monkeypatch.setitem(sys.modules, "amp_patch.legacy.apex.parallel", None)
    with legacy.install_apex_alias():
        with pytest.raises(ApexImportError, match=r"apex\.parallel.*torch\.nn\.parallel\.DistributedDataParallel"):
            from apex.parallel import DistributedDataParallel  # noqa: F401
        import apex
        with pytest.raises(ApexAttributeError, match="torch.nn.SyncBatchNorm.convert_sync_batchnorm"):
            apex.parallel  # noqa: B018 - the attribute read is what raises


@pytest.fixture
def real_packages(tmp_path, monkeypatch):
    """A real `apex` (with apex.other, without amp and parallel) and a real top-level `amp_C` on sys.path."""
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("REAL_APEX = True\n")
    (tmp_path / "apex" / "other.py").write_text("WHO = 'real apex.other'\n")
    (tmp_path / "amp_C.py").write_text("WHO = 'real amp_C'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path


def test_real_apex_and_amp_c_are_never_shadowed(mirror, real_packages):
    (real_packages / "apex" / "parallel.py").write_text("WHO = 'real apex.parallel'\n")
    importlib.invalidate_caches()
    with legacy.install_apex_alias():
        import amp_C
        import apex.parallel
        assert amp_C.WHO == "real amp_C" and apex.parallel.WHO == "real apex.parallel" and apex.REAL_APEX
        assert apex.amp.initialize is legacy.apex_amp.initialize


def test_real_apex_gets_the_mirrored_modules_it_lacks_until_uninstall(mirror, real_packages):
    apex = importlib.import_module("apex")
    with legacy.install_apex_alias():
        from apex.other import WHO
        from apex.parallel import DistributedDataParallel
        assert DistributedDataParallel is StandInDDP and WHO == "real apex.other"
        assert apex.parallel.__name__ == "apex.parallel"
    assert sys.modules["apex"] is apex and not hasattr(apex, "parallel") and not hasattr(apex, "amp")
    with pytest.raises(ImportError):
        importlib.import_module("apex.parallel")


# -- package metadata ---------------------------------------------------------------------------------------
def test_apex_distribution_exists_only_while_the_alias_is_installed():
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")
    with legacy.install_apex_alias():
        assert importlib.metadata.version("apex") == amp_patch.__version__
        assert importlib.metadata.distribution("apex").metadata["Name"] == "apex"
        assert [d.metadata["Name"] for d in importlib.metadata.distributions()].count("apex") == 1
        assert importlib.metadata.packages_distributions()["apex"] == ["apex"]
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("apex")


def test_transformers_sees_apex_through_its_own_check():
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    # transformers caches this at its import (_apex_available); a script run by `amp-patch run` imports
    # transformers after the alias is installed, which is what the uncached check below reproduces.
    assert import_utils._is_package_available("apex") is False
    with legacy.install_apex_alias():
        assert import_utils._is_package_available("apex", return_version=True) == (True, amp_patch.__version__)
    assert import_utils._is_package_available("apex") is False


def test_a_real_apex_distribution_keeps_its_metadata(real_packages):
    info = real_packages / "apex-25.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: apex\nVersion: 25.9\n")
    with legacy.install_apex_alias():
        assert importlib.metadata.version("apex") == "25.9"
        assert [d.version for d in importlib.metadata.distributions() if d.metadata["Name"] == "apex"] == ["25.9"]


# -- apex.amp._amp_state ------------------------------------------------------------------------------------
def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_amp_state_reads_and_writes_the_live_scalers():
    with legacy.install_apex_alias():
        from apex import amp
        from apex.amp import _amp_state
        from apex.amp._amp_state import _amp_state as same
        assert same is _amp_state is amp._amp_state
        with pytest.raises(amp_patch.NotInitializedError, match="before amp.initialize"):
            _amp_state.loss_scalers  # noqa: B018 - the attribute read is what raises
        assert not hasattr(_amp_state, "opt_properties")
        model, opt = amp.initialize(*_tiny(), opt_level="O2", num_losses=2, verbosity=0)
        scalers = _amp_state.loss_scalers
        assert [s.loss_scale() for s in scalers] == [2.0 ** 16] * 2 and scalers[0].dynamic
        scalers[1]._loss_scale = 4.0
        assert amp_patch.loss_scale(1) == 4.0 and _amp_state.loss_scalers[1]._loss_scale == 4.0
        with pytest.raises(amp_patch.ConfigError):
            scalers[1]._loss_scale = -1.0
        assert amp_patch.loss_scale(1) == 4.0
        loss = model(torch.ones(3, 4)).float().sum()
        with amp.scale_loss(loss, opt, loss_id=1) as scaled:
            assert scaled.item() == pytest.approx(4.0 * loss.item())  # the written scale is the one used
            scaled.backward()
        opt.step()
        assert scalers[1]._unskipped == 1 and amp.state_dict()["loss_scaler1"]["unskipped"] == 1
        scalers[1]._unskipped = 1999
        assert amp.state_dict()["loss_scaler1"]["unskipped"] == 1999 and not scalers[1]._has_overflow
        with pytest.raises(amp_patch.UsageError, match="cannot be set"):
            scalers[0].loss_scale = 3.0
        assert scalers[0].update_scale() is False  # NVIDIA BERT's recipe calls it
        assert scalers[0]._scale_seq_len == 2000  # Apex's name for the growth interval
        with pytest.raises(ApexAttributeError):
            # an Apex LossScaler attribute nobody set: the read is what raises
            scalers[0]._no_such_internal  # noqa: B018


def test_amp_state_opt_properties_and_handle_deactivate():
    _amp_state = legacy.amp._amp_state
    linear = F.linear
    model, opt = amp_patch.initialize(*_tiny(), opt_level="O1", loss_scale=128.0, verbosity=0)
    props = _amp_state.opt_properties
    assert (props.enabled, props.opt_level, props.loss_scale, props.master_weights, props.cast_model_type,
            props.patch_torch_functions) == (True, "O1", 128.0, None, None, True)  # (master_weights: Apex's O1 None)
    assert props.options["opt_level"] == "O1" and _amp_state.min_loss_scale is None
    assert _amp_state.max_loss_scale == 2.0 ** 24
    with pytest.raises(amp_patch.UsageError, match="read only"):
        props.opt_level = "O2"
    with pytest.raises(amp_patch.UsageError, match="cannot be set"):
        _amp_state.loss_scalers = []
    assert F.linear is not linear and _amp_state.handle.is_active()
    _amp_state.handle._deactivate()
    assert amp_patch.session.state.current() is None and F.linear is linear  # every patch removed
    assert not _amp_state.handle.is_active()
    _amp_state.handle._deactivate()  # twice: a no-op


def test_old_handle_default_scaler_is_the_session_scaler():
    handle = legacy.amp.init(loss_scale=128.0)
    assert handle._default_scaler.loss_scale() == 128.0
    handle._default_scaler._loss_scale = 32.0
    assert legacy.amp.state_dict()["loss_scaler0"]["loss_scale"] == 32.0
    handle._deactivate()


# -- Apex semantics: half models, cast_model_type=False, NotImplementedError ----------------------------------
class TwoWeights(torch.nn.Module):
    """Apex's multiple-models test model: an fp32 weight and an fp16 weight, both used in fp32."""

    def __init__(self, unique):
        super().__init__()
        self.weight0 = torch.nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = torch.nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float16))

    def forward(self, x):
        return (x * self.weight0.float() * self.weight1.float()).sum()


def _two_models_run(level=None, inject_inf_at=None):
    """Apex's 2-models/2-losses/1-optimizer loop; with ``level`` under amp with loss scales 4 and 16."""
    _amp_state = legacy.amp._amp_state
    models = [TwoWeights(1), TwoWeights(2)]
    opt = torch.optim.SGD([{"params": models[0].parameters(), "lr": 0.25},
                           {"params": models[1].parameters(), "lr": 0.5}], momentum=0.125)
    if level is not None:
        _amp_state.allow_incoming_model_not_fp32 = True
        models, opt = legacy.amp.initialize(models, opt, opt_level=level, verbosity=0, cast_model_type=False,
                                            num_losses=2)
        _amp_state.allow_incoming_model_not_fp32 = False
        _amp_state.loss_scalers[0]._loss_scale = 4.0
        _amp_state.loss_scalers[1]._loss_scale = 16.0
    x, grads = torch.ones(2), []
    for i in range(3 if inject_inf_at is not None else 2):
        opt.zero_grad()
        for loss_id, model in enumerate(models):
            loss = model(x)
            if level is None:
                loss.backward()
                continue
            with legacy.amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward()
                if i == inject_inf_at and loss_id == 1:
                    model.weight1.grad[0] = float("inf")
        if i != inject_inf_at:
            grads.append([p.grad.float().clone() for p in (legacy.amp.master_params(opt) if level else
                                                            [q for m in models for q in m.parameters()])])
        opt.step()
    params = [p.detach().clone() for m in models for p in m.parameters()]
    if level is not None:
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(params, legacy.amp.master_params(opt)))
        assert [p.dtype for p in params] == [torch.float32, torch.float16] * 2  # cast_model_type=False: as given
        _amp_state.handle._deactivate()
    return grads, params


@pytest.mark.parametrize("level,inject", [("O0", None), ("O1", None), ("O1", 1), ("O2", None), ("O2", 0),
                                          ("O3", None)])
def test_apex_multiple_models_shape_with_half_params_and_cast_model_type_false(level, inject):
    ref_grads, ref_params = _two_models_run()
    grads, params = _two_models_run(level, inject)
    assert len(grads) == 2
    for got, want in zip(grads, ref_grads):
        assert all(torch.allclose(g, w) for g, w in zip(got, want))
    assert all(torch.allclose(p, r) for p, r in zip(params, ref_params))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_a_model_arriving_in_half_is_refused_with_apex_explanation(half):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(half))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(amp_patch.UsageError, match=r"parameter '1\.weight'.*\.half\(\).*allow_incoming_model_not_fp32"
                       ) as info:
        amp_patch.initialize(model, opt, opt_level="O2", verbosity=0)
    assert isinstance(info.value, RuntimeError) and amp_patch.session.state.current() is None
    assert model[1].weight.dtype is half and model[0].weight.dtype is torch.float32  # untouched
    buffered = torch.nn.BatchNorm1d(2)
    buffered.running_mean = buffered.running_mean.to(half)
    with pytest.raises(amp_patch.UsageError, match="buffer 'running_mean'"):
        amp_patch.initialize(buffered, opt_level="O1", verbosity=0)
    amp_patch.initialize(model, opt, opt_level="O2", verbosity=0, allow_incoming_model_not_fp32=True)


def test_cast_model_type_false_leaves_the_model_as_it_is():
    model, opt = _tiny()
    amp_patch.initialize(model, opt, opt_level="O2", cast_model_type=False, verbosity=0)
    assert model.weight.dtype is torch.float32 and model(torch.ones(1, 4)).dtype is torch.float32
    assert amp_patch.legacy.amp._amp_state.opt_properties.master_weights
    amp_patch.deinitialize()
    amp_patch.initialize(model, opt, opt_level="O0", cast_model_type=False, verbosity=0)
    assert model.weight.dtype is torch.float32


def test_banned_and_inplace_float_ops_raise_not_implemented_as_in_apex():
    handle = legacy.amp.init()
    half = torch.rand(4, 3).half()
    with pytest.raises(NotImplementedError):
        torch.nn.BCELoss()(torch.sigmoid(half), half)
    with pytest.raises(NotImplementedError):
        half.exp_()
    exp = torch.rand(3)
    exp.exp_()  # fp32 in place is fine
    handle._deactivate()
    handle = legacy.amp.init(allow_banned=True)
    assert torch.nn.BCELoss()(torch.sigmoid(half), half).dtype is torch.float32
    handle._deactivate()


def test_amp_state_has_apexs_verbosity_and_maybe_print(capsys):
    from amp_patch.legacy.alias import install_apex_alias, uninstall_apex_alias

    install_apex_alias()
    try:
        from apex.amp._amp_state import _amp_state, maybe_print

        assert _amp_state.verbosity == 1  # Apex's fresh AmpState
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        import apex

        apex.amp.initialize(model, opt, opt_level="O1", verbosity=0)
        assert _amp_state.verbosity == 0
        capsys.readouterr()
        maybe_print("quiet")
        assert capsys.readouterr().out == ""
        amp_patch.deinitialize()
        maybe_print("a script's line", rank0=True)
        assert capsys.readouterr().out == "a script's line\n"
    finally:
        amp_patch.deinitialize()
        uninstall_apex_alias()
