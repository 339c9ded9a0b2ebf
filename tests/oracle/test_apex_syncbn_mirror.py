"""The ``syncbn`` stand-in (Apex's SyncBatchNorm extension) against torch's own batch norm: its forward
(``torch.nn.functional.batch_norm``) and autograd through it for the backward pieces, NCHW and channel-last,
fp32 and half (statistics in fp32, as Apex's kernels kept them)."""
import pytest
import torch
import torch.nn.functional as F

from amp_patch.legacy import syncbn

EPS = 1e-5
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-2, atol=2e-2)}
CASES = [(dtype, wdtype) for dtype in (torch.float32, torch.float16) for wdtype in (dtype, torch.float32)]


def _data(dtype, wdtype, shape=(4, 3, 5, 6), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    c = shape[1]
    w = (torch.rand(c, generator=gen) + 0.5).to(wdtype)
    b = torch.randn(c, generator=gen).to(wdtype)
    return x, dy, w, b


def _torch_bn(x, dy, w, b):
    """Output and grads of torch's training-mode batch norm, computed in fp32 from the same values."""
    x32 = x.detach().float().requires_grad_()
    w32, b32 = w.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    out = F.batch_norm(x32, None, None, w32, b32, training=True, eps=EPS)
    out.backward(dy.float())
    return out.detach(), x32.grad, w32.grad, b32.grad


def _c_last(t):
    return t.movedim(1, -1).contiguous()


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,wdtype", CASES)
@pytest.mark.parametrize("layout", ["nchw", "c_last"])
def test_forward_and_backward_pieces_match_torch_batch_norm(dtype, wdtype, layout):
    x, dy, w, b = _data(dtype, wdtype)
    out_r, dx_r, dw_r, db_r = _torch_bn(x, dy, w, b)
    count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.int32)
    if layout == "nchw":
        mean, var = syncbn.welford_mean_var(x)
        inv_std = 1.0 / torch.sqrt(var + EPS)
        out = syncbn.batchnorm_forward(x, mean, inv_std, w, b)
        sum_dy, sum_dy_xmu, dw, db = syncbn.reduce_bn(dy, x, mean, inv_std, w)
        dx = syncbn.batchnorm_backward(dy, x, mean, inv_std, w, sum_dy, sum_dy_xmu, count)
    else:
        xc, dyc = _c_last(x), _c_last(dy)
        mean, var = syncbn.welford_mean_var_c_last(xc)
        inv_std = 1.0 / torch.sqrt(var + EPS)
        out = syncbn.batchnorm_forward_c_last(xc, None, mean, inv_std, w, b, False).movedim(-1, 1)
        sum_dy, sum_dy_xmu, dw, db = syncbn.reduce_bn_c_last(dyc, xc, mean, inv_std, w)
        dx = syncbn.batchnorm_backward_c_last(dyc, xc, mean, inv_std, w, sum_dy, sum_dy_xmu, count).movedim(-1, 1)
    x64 = x.double()
    # the statistics are fp32 sums of exactly representable values: fp32's tolerance for half inputs too
    _close(mean, x64.mean((0, 2, 3)), torch.float32)
    _close(var, x64.var((0, 2, 3), unbiased=False), torch.float32)
    assert mean.dtype == var.dtype == inv_std.dtype == sum_dy.dtype == sum_dy_xmu.dtype == torch.float32
    assert out.dtype == dx.dtype == dtype and dw.dtype == db.dtype == wdtype
    _close(out, out_r, dtype)
    _close(dx, dx_r, dtype)
    _close(dw, dw_r, dtype)
    _close(db, db_r, dtype)
    _close(sum_dy, dy.double().sum((0, 2, 3)), torch.float32)
    xmu = x64 - x64.mean((0, 2, 3), keepdim=True)
    _close(sum_dy_xmu, (dy.double() * xmu).sum((0, 2, 3)), torch.float32)


def test_without_weight_the_forward_is_plain_normalisation_and_weight_grads_are_empty():
    x, dy, _, _ = _data(torch.float32, torch.float32)
    mean, var = syncbn.welford_mean_var(x)
    inv_std = 1.0 / torch.sqrt(var + EPS)
    out = syncbn.batchnorm_forward(x, mean, inv_std, None, None)
    torch.testing.assert_close(out, F.batch_norm(x, None, None, training=True, eps=EPS), rtol=1e-4, atol=1e-4)
    _, _, dw, db = syncbn.reduce_bn(dy, x, mean, inv_std, None)
    assert dw.numel() == db.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_welford_parallel_combines_per_rank_statistics_into_the_whole_batch(dtype):
    x, _, _, _ = _data(dtype, dtype, shape=(7, 3, 4, 4))
    parts = [x[:2], x[2:3], x[3:]]  # ranks with different batch sizes
    stats = [syncbn.welford_mean_var(p) for p in parts]
    means = torch.stack([m for m, _ in stats])
    variances = torch.stack([v for _, v in stats])
    counts = torch.tensor([p.numel() // p.shape[1] for p in parts], dtype=torch.int32)
    mean, var, inv_std = syncbn.welford_parallel(means, variances, counts, EPS)
    x64 = x.double()
    _close(mean, x64.mean((0, 2, 3)), dtype)
    _close(var, x64.var((0, 2, 3), unbiased=True), dtype)
    _close(inv_std, 1.0 / torch.sqrt(x64.var((0, 2, 3), unbiased=False) + EPS), dtype)
    # the backward divides by the sum of the ranks' counts: with the counts split it is the whole batch's grad
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    w, b = torch.ones(3, dtype=dtype), torch.zeros(3, dtype=dtype)
    _, dx_r, _, _ = _torch_bn(x, dy, w, b)
    sum_dy, sum_dy_xmu, _, _ = syncbn.reduce_bn(dy, x, mean, inv_std, w)
    _close(syncbn.batchnorm_backward(dy, x, mean, inv_std, w, sum_dy, sum_dy_xmu, counts), dx_r, dtype)


def test_channel_last_fused_relu_adds_z_then_clamps_and_its_backward_masks_the_grad():
    x, dy, w, b = (_c_last(t) if t.dim() == 4 else t for t in _data(torch.float32, torch.float32))
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    mean, var = syncbn.welford_mean_var_c_last(x)
    inv_std = 1.0 / torch.sqrt(var + EPS)
    plain = syncbn.batchnorm_forward_c_last(x, None, mean, inv_std, w, b, False)
    fused = syncbn.batchnorm_forward_c_last(x, z, mean, inv_std, w, b, True)
    torch.testing.assert_close(fused, torch.relu(plain + z))
    grad = syncbn.relu_bw_c_last(dy, x, z, mean, inv_std, w, b)
    torch.testing.assert_close(grad, torch.where(plain + z > 0, dy, torch.zeros(())))


def test_syncbn_is_served_as_a_top_level_module_under_the_apex_alias():
    from amp_patch.legacy.mirror import mirror_name
    assert mirror_name("syncbn") == "amp_patch.legacy.syncbn"


# Apex's own check of the extension (tests/distributed/synced_batchnorm/single_gpu_unit_test.py), run on CPU under
# the alias: CUDA tensor types become CPU ones, ``compare`` records each check (29 of them, 8 of them on
# apex.parallel.SyncBatchNorm(channel_last=True)); every check must pass.
_SCRIPT = "tests/distributed/synced_batchnorm/single_gpu_unit_test.py"
_CPU = (("torch.cuda.IntTensor(", "torch.IntTensor("), ("torch.cuda.FloatTensor", "torch.FloatTensor"),
        ("torch.cuda.DoubleTensor", "torch.DoubleTensor"), (".cuda()", ""), ("def compare(", "def _apex_compare("))
_RECORD = ("CHECKS = []\ndef compare(desc, a, b, error):\n"
           "    CHECKS.append((desc, bool(_apex_compare(desc, a, b, error))))\n    return CHECKS[-1][1]\n")


def _cpu_script(text):
    for old, new in _CPU:
        text = text.replace(old, new)
    return _RECORD + text


def test_apex_single_gpu_unit_test_checks_pass_on_cpu(capsys):
    import os
    import pathlib
    src = os.environ.get("AMP_PATCH_APEX_SRC")
    if not src or not (pathlib.Path(src) / _SCRIPT).is_file():
        pytest.skip(f"AMP_PATCH_APEX_SRC does not hold Apex's {_SCRIPT}")
    from amp_patch.legacy import install_apex_alias, uninstall_apex_alias
    install_apex_alias()
    try:
        namespace = {"__name__": "apex_single_gpu_unit_test"}
        exec(compile(_cpu_script((pathlib.Path(src) / _SCRIPT).read_text()), _SCRIPT, "exec"), namespace)
    finally:
        uninstall_apex_alias()
    checks = namespace["CHECKS"]
    failed = [desc for desc, ok in checks if not ok]
    assert len(checks) == 29 and not failed, (failed, capsys.readouterr().out)
    assert namespace["syncbn"].reduce_bn is syncbn.reduce_bn  # the script's `import syncbn` got the stand-in
    out = capsys.readouterr().out
    assert "====SBN single gpu passed tests" in out and "====SBN channel last single gpu passed tests" in out


def test_channel_last_sync_batchnorm_takes_and_returns_nhwc_with_torch_batch_norm_values():
    from amp_patch.legacy.apex.parallel import SyncBatchNorm, convert_syncbn_model
    x, dy, w, b = _data(torch.float32, torch.float32)
    out_r, dx_r, dw_r, db_r = _torch_bn(x, dy, w, b)
    sbn = convert_syncbn_model(torch.nn.BatchNorm2d(3), channel_last=True)
    assert isinstance(sbn, SyncBatchNorm) and sbn.channel_last
    with torch.no_grad():
        sbn.weight.copy_(w), sbn.bias.copy_(b)
    xc = _c_last(x).requires_grad_()
    out = sbn(xc)
    out.backward(_c_last(dy))
    assert out.shape == xc.shape and out.is_contiguous()
    for got, expected in [(out.movedim(-1, 1), out_r), (xc.grad.movedim(-1, 1), dx_r), (sbn.weight.grad, dw_r),
                          (sbn.bias.grad, db_r), (sbn.running_mean, 0.1 * x.mean((0, 2, 3)))]:
        _close(got, expected, torch.float32)
