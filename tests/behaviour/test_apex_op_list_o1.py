"""Apex O1 behaviours of the shipped ``apex`` op list (fp16 on CPU), and data checks of every shipped list."""
import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

import amp_patch

H = torch.float16
SHIPPED = ("apex", "torch_cpu", "torch_cuda")


def apex():
    return amp_patch.autocast(op_lists="apex", half_dtype=H)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


# ---------------------------------------------------------------------------------------------- half ops

def test_linear_runs_in_half(gen):
    x, w, b = randn(gen, 4, 8), randn(gen, 3, 8), randn(gen, 3)
    with apex():
        out = F.linear(x, w, b)
    assert out.dtype == H
    assert torch.equal(out, F.linear(x.half(), w.half(), b.half()))


def test_linear_module_runs_in_half(gen):
    lin = nn.Linear(8, 3)
    x = randn(gen, 4, 8)
    with apex():
        out = lin(x)
    assert out.dtype == H
    assert lin.weight.dtype == torch.float32  # O1 never touches the parameters


def test_conv2d_module_runs_in_half(gen):
    conv = nn.Conv2d(2, 3, 3)
    x = randn(gen, 1, 2, 6, 6)
    with apex():
        out = conv(x)
    assert out.dtype == H
    assert torch.equal(out, F.conv2d(x.half(), conv.weight.half(), conv.bias.half()))
    assert conv.weight.dtype == torch.float32


def test_matmul_runs_in_half(gen):
    a, b = randn(gen, 4, 5), randn(gen, 5, 6)
    with apex():
        outs = {"torch.matmul": torch.matmul(a, b), "@": a @ b, "Tensor.matmul": a.matmul(b), "mm": torch.mm(a, b)}
    expected = torch.matmul(a.half(), b.half())
    for what, out in outs.items():
        assert out.dtype == H, what
        assert torch.equal(out, expected), what


def test_half_input_stays_half_for_half_ops(gen):
    a, b = randn(gen, 4, 5, dtype=H), randn(gen, 5, 6, dtype=H)
    with apex():
        assert (a @ b).dtype == H


# --------------------------------------------------------------------------------------------- float ops

def _float_cases(gen):
    x = randn(gen, 4, 6, dtype=H)
    target = torch.tensor([0, 2, 1, 5])
    return [
        ("softmax", lambda: F.softmax(x, dim=-1), lambda: F.softmax(x.float(), dim=-1)),
        ("log_softmax", lambda: F.log_softmax(x, dim=-1), lambda: F.log_softmax(x.float(), dim=-1)),
        ("layer_norm", lambda: F.layer_norm(x, (6,)), lambda: F.layer_norm(x.float(), (6,))),
        ("layer_norm_module", lambda: nn.LayerNorm(6)(x), lambda: nn.LayerNorm(6)(x.float())),
        ("group_norm", lambda: F.group_norm(x.view(2, 4, 3), 2), lambda: F.group_norm(x.float().view(2, 4, 3), 2)),
        ("mse_loss", lambda: F.mse_loss(x, x.flip(0)), lambda: F.mse_loss(x.float(), x.float().flip(0))),
        ("cross_entropy", lambda: F.cross_entropy(x, target), lambda: F.cross_entropy(x.float(), target)),
        ("torch.pow", lambda: torch.pow(x, 2), lambda: torch.pow(x.float(), 2)),
        ("Tensor.pow", lambda: x.pow(3), lambda: x.float().pow(3)),
        ("__pow__", lambda: x ** 2, lambda: x.float() ** 2),
        ("__rpow__", lambda: 2 ** x, lambda: 2 ** x.float()),
        ("torch.sum", lambda: torch.sum(x), lambda: torch.sum(x.float())),
        ("Tensor.sum", lambda: x.sum(dim=1), lambda: x.float().sum(dim=1)),
        ("torch.exp", lambda: torch.exp(x), lambda: torch.exp(x.float())),
        ("Tensor.exp", lambda: x.exp(), lambda: x.float().exp()),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _float_cases(torch.Generator().manual_seed(0))])
def test_float_ops_run_in_float32(gen, name):
    case = {c[0]: c for c in _float_cases(gen)}[name]
    with apex():
        out = case[1]()
    assert out.dtype == torch.float32, name
    assert torch.equal(out, case[2]()), name


# ------------------------------------------------------------------------------------- unlisted ops

@pytest.mark.parametrize("dtype", [H, torch.float32], ids=["fp16", "fp32"])
def test_relu_keeps_input_dtype(gen, dtype):
    x = randn(gen, 4, 6, dtype=dtype)
    with apex():
        assert F.relu(x).dtype == dtype
        assert torch.relu(x).dtype == dtype
        assert nn.ReLU()(x).dtype == dtype


@pytest.mark.parametrize("dtype", [H, torch.float32], ids=["fp16", "fp32"])
def test_batch_norm_keeps_input_dtype(gen, dtype):
    bn = nn.BatchNorm2d(3)
    x = randn(gen, 2, 3, 4, 4, dtype=dtype)
    with apex():
        out = bn(x)
        out_f = F.batch_norm(x, torch.zeros(3), torch.ones(3), training=False)
    assert out.dtype == dtype
    assert out_f.dtype == dtype
    assert bn.running_mean.dtype == torch.float32


# ----------------------------------------------------------------------------------------------- promote

def _promote_cases(gen):
    h, f = randn(gen, 5, dtype=H), randn(gen, 5)
    return [
        ("torch.mul", lambda: torch.mul(h, f), lambda: torch.mul(h.float(), f)),
        ("__mul__", lambda: h * f, lambda: h.float() * f),
        ("__rmul__-order", lambda: f * h, lambda: f * h.float()),
        ("torch.add", lambda: torch.add(h, f), lambda: torch.add(h.float(), f)),
        ("__add__", lambda: h + f, lambda: h.float() + f),
        ("Tensor.add", lambda: h.add(f), lambda: h.float().add(f)),
        ("torch.atan2", lambda: torch.atan2(h, f), lambda: torch.atan2(h.float(), f)),
        ("Tensor.atan2", lambda: h.atan2(f), lambda: h.float().atan2(f)),
        ("torch.dot", lambda: torch.dot(h, f), lambda: torch.dot(h.float(), f)),
        ("torch.vdot", lambda: torch.vdot(h, f), lambda: torch.vdot(h.float(), f)),
        ("Tensor.vdot", lambda: f.vdot(h), lambda: f.vdot(h.float())),
        ("torch.cat", lambda: torch.cat([h, f]), lambda: torch.cat([h.float(), f])),
        ("torch.cat-tuple", lambda: torch.cat((f, h), dim=0), lambda: torch.cat((f, h.float()), dim=0)),
        ("torch.stack", lambda: torch.stack([h, f]), lambda: torch.stack([h.float(), f])),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _promote_cases(torch.Generator().manual_seed(0))])
def test_mixed_promote_ops_run_in_float32(gen, name):
    case = {c[0]: c for c in _promote_cases(gen)}[name]
    with apex():
        out = case[1]()
    assert out.dtype == torch.float32, name
    assert torch.equal(out, case[2]()), name


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_spectral_norm_trains_under_o1_with_the_apex_list(half):
    """parametrizations.spectral_norm computes sigma = vdot(u, mv(W, v)): u float, mv half under the apex list.
    vdot is promoted (as Apex promoted dot), so the layer runs; its output and grads are fp32's within half's
    precision."""
    from torch.nn.utils.parametrizations import spectral_norm

    def run(level):
        torch.manual_seed(0)
        model = spectral_norm(nn.Linear(8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if level:
            model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
        try:
            out = model(x)
            loss = out.float().square().mean()
            if level:
                with amp_patch.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            grad = model.parametrizations.weight.original.grad.clone()
            opt.step()
            return out.float().detach(), grad, model(x).float().detach()
        finally:
            if level:
                amp_patch.deinitialize()

    tol = {"atol": 2e-2, "rtol": 2e-2} if half is torch.bfloat16 else {"atol": 3e-3, "rtol": 3e-3}
    for got, want in zip(run("O1"), run(None)):
        torch.testing.assert_close(got, want, **tol)


def test_promote_of_same_dtype_is_untouched(gen):
    a, b = randn(gen, 5, dtype=H), randn(gen, 5, dtype=H)
    with apex():
        assert (a * b).dtype == H
        assert torch.cat([a, b]).dtype == H


def test_inplace_promote_keeps_self_dtype(gen):
    h, f = randn(gen, 5, dtype=H), randn(gen, 5)
    h0, f0 = h.clone(), f.clone()
    with apex():
        h.add_(f)   # half self: the float operand is cast to half
        f += h0     # float self (__iadd__): the half operand is cast to float
    assert h.dtype == H and torch.equal(h, h0 + f0.half())
    assert f.dtype == torch.float32 and torch.equal(f, f0 + h0.float())


def test_inplace_float_op_on_half_raises(gen):
    h = randn(gen, 5, dtype=H)
    with apex():
        with pytest.raises(amp_patch.CastError):
            h.exp_()


_TORCH_INPLACE = [e.name for e in amp_patch.load_op_lists("apex").entries
                  if e.target == "torch" and e.name.endswith("_")]


def test_the_list_has_the_inplace_float_functions_torch_has():
    assert sorted(_TORCH_INPLACE) == sorted(
        n + "_" for n in ("acos asin cosh erfinv exp expm1 log log10 log2 reciprocal rsqrt sinh tan pow cumprod "
                          "cumsum dist norm prod std sum var renorm").split() if hasattr(torch, n + "_"))


@pytest.mark.parametrize("name", _TORCH_INPLACE)
def test_inplace_float_function_of_the_torch_namespace_on_half_raises_and_fp32_runs_in_place(gen, name):
    """Apex: "for any in-place version of a blacklist function, error if any input is fp16"; an fp32 tensor is
    written in place (a casting wrapper would have written a cast copy and dropped the result)."""
    h, f = randn(gen, 5, dtype=H).abs() / 2, randn(gen, 5).abs() / 2  # (in every op's domain)
    expected = getattr(torch, name.rstrip("_"))(f)
    with apex():
        with pytest.raises(amp_patch.CastError) as info:
            getattr(torch, name)(h)
        assert isinstance(info.value, NotImplementedError)
        assert getattr(torch, name)(f) is f
    assert torch.equal(f, expected)


# ------------------------------------------------------------------------------------------------ banned

def test_binary_cross_entropy_is_banned(gen):
    p = torch.rand(4, 3, generator=gen).half()
    t = torch.rand(4, 3, generator=gen).half()
    with apex():
        with pytest.raises(amp_patch.BannedOpError) as info:
            F.binary_cross_entropy(p, t)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "BCEWithLogitsLoss" in message
    assert "register_float_function(torch, 'sigmoid')" in message
    assert "allow_banned=True" in message


def test_bce_loss_module_is_banned(gen):
    p = torch.rand(4, 3, generator=gen).half()
    t = torch.rand(4, 3, generator=gen).half()
    with apex():
        with pytest.raises(amp_patch.BannedOpError):
            nn.BCELoss()(p, t)


def test_bce_with_logits_is_float(gen):
    x = randn(gen, 4, 3, dtype=H)
    t = torch.rand(4, 3, generator=gen).half()
    with apex():
        out = F.binary_cross_entropy_with_logits(x, t)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.binary_cross_entropy_with_logits(x.float(), t.float()))


# --------------------------------------------------------------------------------------------- gradients

def test_gradients_keep_parameter_dtype(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    x = randn(gen, 4, 8)
    with apex():
        hidden = model(x)
        assert hidden.dtype == H
        loss = F.mse_loss(hidden, torch.zeros(4, 2))
        assert loss.dtype == torch.float32
    loss.backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None, name
        assert p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


# ---------------------------------------------------------------------------------------- data checks

@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_list_loads_and_stays_inside_torch(name):
    table = amp_patch.load_op_lists(name)
    assert len(table.entries) > 0
    categories = {"half", "float", "promote", "sequence_promote", "banned"}
    for e in table.entries:
        assert e.target == "torch" or e.target.startswith("torch."), e
        assert e.category in categories, e
        assert e.message is None or e.category == "banned", e
    # the table is keyed by (target, name), so a duplicate can only be seen in the file itself
    raw = yaml.safe_load((amp_patch.config.oplist._shipped_dir() / f"{name}.yaml").read_text())  # (a Traversable)
    listed = collections.Counter((target, item if isinstance(item, str) else item["name"])
                                 for category in categories for target, items in (raw.get(category) or {}).items()
                                 for item in items)
    assert [key for key, n in listed.items() if n > 1] == [], "listed twice"
    assert len(listed) == len(table.entries) + len(table.skipped)


def test_shipped_names():
    assert set(SHIPPED) <= set(amp_patch.shipped_names())


def test_apex_list_contents():
    table = amp_patch.load_op_lists("apex")
    cat = {(e.target, e.name): e.category for e in table.entries}
    assert cat[("torch.nn.functional", "linear")] == "half"
    assert cat[("torch.Tensor", "__matmul__")] == "half"
    assert cat[("torch.nn.functional", "softmax")] == "float"
    assert cat[("torch.Tensor", "cpu")] == "float"
    assert cat[("torch.Tensor", "exp_")] == "float"
    assert cat[("torch.Tensor", "__iadd__")] == "promote"
    assert cat[("torch.Tensor", "add_")] == "promote"
    assert cat[("torch", "cat")] == "sequence_promote"
    assert cat[("torch", "stack")] == "sequence_promote"
    assert cat[("torch.nn.functional", "binary_cross_entropy")] == "banned"
    dunders = {n for (t, n), c in cat.items() if t == "torch.Tensor" and c == "promote" and n.startswith("__")}
    assert len(dunders) == 21
    banned = [e for e in table.entries if e.category == "banned"]
    assert len(banned) == 1 and "BCEWithLogitsLoss" in banned[0].message
