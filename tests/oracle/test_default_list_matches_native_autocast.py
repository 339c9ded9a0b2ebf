"""Without ``op_lists``, ``amp_patch.initialize`` loads native autocast's list for the models' device: on CPU, an
O1 bfloat16 training iteration is bitwise equal to the same program under ``torch.autocast("cpu")``.

The oracle is torch itself: the same model (same seed), the same batch, forward and loss under native CPU
autocast, ``loss.backward()``; against amp_patch O1 (default list), ``scale_loss`` (bf16: scale 1.0). Every
module's output (dtype and bits), the loss and every gradient must be equal. Under the ``apex`` list they are not
(GELU runs in fp32 there), which a test shows: the comparison can fail.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch
from amp_patch.session.state import active_engine


def _mlp():
    layers = []
    for _ in range(3):
        layers += [nn.Linear(32, 32), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(32, 10)), torch.randn(16, 32)


def _convnet():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, stride=(2, 2), padding=(1, 1)), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    return model, torch.randn(4, 3, 16, 16)


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, activation="gelu")
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


def _encoder():
    return _Encoder(), torch.randn(4, 8, 32)


MODELS = {"mlp_gelu": _mlp, "convnet_batchnorm": _convnet, "transformer_layer": _encoder}


def _record_outputs(model):
    """Every module's tensor output, by module path, as the forward produces it (dtype included)."""
    seen = {}
    for path, module in model.named_modules():
        def hook(_module, _args, out, path=path):
            if isinstance(out, torch.Tensor):
                seen[path] = out.detach().clone()
        module.register_forward_hook(hook)
    return seen


def _native(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        loss = F.cross_entropy(out, y)
    loss.backward()
    return loss


def _ours(model, x, y, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0, **kwargs)
    try:
        loss = F.cross_entropy(model(x), y)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss.detach()
    finally:
        amp_patch.deinitialize()


def _run_both(name, **kwargs):
    """(native, ours) for one iteration: each a dict of the module outputs, the loss and every grad."""
    torch.manual_seed(0)
    base, x = MODELS[name]()
    y = torch.randint(0, 10, (x.shape[0],))
    results = []
    for run in (_native, lambda m, x, y: _ours(m, x, y, **kwargs)):
        model = copy.deepcopy(base)
        seen = _record_outputs(model)
        seen["loss"] = run(model, x, y)
        seen.update({f"grad of {n}": p.grad for n, p in model.named_parameters()})
        results.append(seen)
    return results


def _differences(native, ours):
    assert native.keys() == ours.keys()
    return [f"{k}: {native[k].dtype} vs {ours[k].dtype}" for k in native
            if not (native[k].dtype == ours[k].dtype and torch.equal(native[k], ours[k]))]


@pytest.mark.parametrize("name", list(MODELS))
def test_default_list_o1_is_bitwise_native_cpu_autocast(name):
    native, ours = _run_both(name)
    assert _differences(native, ours) == []


def test_the_apex_list_is_not_native_autocast():
    """The same comparison with ``op_lists="apex"``: GELU runs in fp32 there (its output is float32)."""
    native, ours = _run_both("mlp_gelu", op_lists="apex")
    assert "1: torch.bfloat16 vs torch.float32" in _differences(native, ours)


def test_the_default_list_is_the_devices_torch_list():
    model = nn.Linear(4, 4)
    amp_patch.initialize(model, opt_level="O1", verbosity=0)
    try:
        table = active_engine().table
        assert table.sources == ("op_lists/torch_cpu.yaml",)
        assert table.get("torch.nn.functional", "gelu") is None  # not in native CPU autocast's lists
        assert table.get("torch.nn.functional", "linear").category == "half"
    finally:
        amp_patch.deinitialize()


class _FrontEnd(nn.Module):
    """A half Linear front end feeding an fp32 module that checks dtypes itself (RNN, fused encoder layer)."""

    def __init__(self, body):
        super().__init__()
        self.fc, self.body = nn.Linear(16, 16), body

    def forward(self, x):
        out = self.body(self.fc(x))
        return out[0] if isinstance(out, tuple) else out


BODIES = {"lstm": lambda: nn.LSTM(16, 16, batch_first=True), "gru_cell": lambda: nn.GRUCell(16, 16),
          "encoder_eval": lambda: nn.TransformerEncoder(
              nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2, enable_nested_tensor=False).eval()}


@pytest.mark.parametrize("body", list(BODIES))
def test_half_activations_into_dtype_checking_modules_run_as_natively(body):
    """Native CPU autocast runs these on a half input (their kernels are cast inside C++); the default list
    casts them at their Python entry, so they run, in half, instead of failing on the dtype mismatch."""
    torch.manual_seed(0)
    model = _FrontEnd(BODIES[body]())
    x = torch.randn(2, 5, 16) if body != "gru_cell" else torch.randn(4, 16)
    with torch.no_grad():
        reference = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            native = model(x)
        model = amp_patch.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
        try:
            ours = model(x)
        finally:
            amp_patch.deinitialize()
    assert ours.dtype is native.dtype is torch.bfloat16
    torch.testing.assert_close(ours.float(), reference, rtol=0, atol=0.1)


@pytest.mark.parametrize("job_name", ["mlp", "cnn"])
def test_the_experiments_o1_row_trains_bitwise_as_its_native_row(job_name):
    """The experiment's own runs agree with the oracle: O1 under the default list and native autocast give the
    same losses, step by step, on the built-in jobs (its data made before the variant's setup, in fp32)."""
    from amp_patch.tools.experiment import models, runner
    from amp_patch.tools.experiment.api import make_config

    config = make_config(12, torch.bfloat16, "cpu", 0, threads=1, rounds=1)
    job = getattr(models, job_name)()
    o1 = runner.run_variant(job, "O1", config)["losses"]
    native = runner.run_variant(getattr(models, job_name)(), "native", config)["losses"]
    assert len(o1) == 12 and o1 == native
