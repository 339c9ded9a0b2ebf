"""A sweep over torch.nn's own layer zoo under O1/O2/O3 x fp16/bf16.

Every torch.nn module class (tests/_nn_zoo.py: small constructor arguments and inputs; abstract bases and
containers without forward excluded) runs forward and backward in one zoo model initialized once per
configuration: outputs and input grads finite, output dtypes as the opt level says (O2/O3: the model's output
cast to fp32; O1: half where the module's last op is on the half list, fp32 otherwise, e.g. a transformer layer
ends in a float-list layer_norm). Prints the coverage figure (module runs over all six configurations) and fails
below 95% or on any failure not in EXPECTED_FAILURES (listed in docs/coverage.md with the reason).
"""

import _nn_zoo as zoo_specs
import pytest
import torch

import amp_patch

HALVES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: O1: modules whose output the op lists make half (their main op is on the half list); all others fp32
O1_HALF = {"Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "LazyConv1d",
           "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d", "LazyConvTranspose2d", "LazyConvTranspose3d", "Linear",
           "LazyLinear", "RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell", "MultiheadAttention", "Sequential"}
#: (level, module) -> reason where a module cannot run (docs/coverage.md). O2/O3 hand the module half tensors
#: and patch no op, so a layer whose op has no half kernel on this device fails as it would in plain torch.
_NO_CPU_HALF = "torch has no {} CPU kernel for float16/bfloat16 (O2/O3 run the op on half tensors; CUDA has it)"
EXPECTED_FAILURES = {(level, name): _NO_CPU_HALF.format(op) for level in ("O2", "O3") for name, op in [
    ("AvgPool3d", "avg_pool3d"), ("LPPool3d", "avg_pool3d"), ("LocalResponseNorm", "avg_pool3d"),
    ("CTCLoss", "ctc_loss"), ("MultiLabelMarginLoss", "multilabel_margin_loss"),
    ("MultiMarginLoss", "multi_margin_loss"), ("RReLU", "rrelu_with_noise (float16 only)")]}


class Zoo(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mods = torch.nn.ModuleDict({name: ctor() for name, (ctor, _) in zoo_specs.SPECS.items()})
        for name, (_, inputs) in zoo_specs.SPECS.items():  # materialise the lazy modules in fp32
            if "Lazy" in name:
                self.mods[name](*inputs())

    def forward(self, name, *args):
        return self.mods[name](*args)


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


def _floats(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _floats(o)]
    return [t for t in (getattr(out, "output", None), getattr(out, "loss", None)) if t is not None]


def _run_one(zoo, opt, name, level, half):
    torch.manual_seed(1)
    args = list(zoo_specs.SPECS[name][1]())
    if args[0].is_floating_point():  # the input; targets and indices stay constants
        args[0] = args[0].detach().requires_grad_()
    outs = _floats(zoo(name, *args))
    assert outs, "no floating output"
    assert all(torch.isfinite(t).all() for t in outs), "non-finite output"
    want = (half if name in O1_HALF else torch.float32) if level == "O1" else torch.float32
    assert outs[0].dtype is want, f"output {outs[0].dtype}, expected {want}"
    loss = sum(t.float().mean() for t in outs if t.requires_grad)
    if isinstance(loss, torch.Tensor):
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        assert not amp_patch.last_step_skipped(opt)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
        assert all(torch.isfinite(a.grad).all() for a in leaves), "non-finite input grad"
    opt.zero_grad()


def _sweep(zoo, level, half):
    opt = torch.optim.SGD(zoo.parameters(), lr=0.0)
    lists = {"op_lists": "apex"} if level == "O1" else {}  # O1_HALF is the dtype table of Apex's list
    model, opt = amp_patch.initialize(zoo, opt, opt_level=level, half_dtype=half, verbosity=0, loss_scale=128.0,
                                      **lists)
    failures = {}
    try:
        for name in zoo_specs.zoo_classes():
            try:
                _run_one(model, opt, name, level, half)
            except Exception as exc:  # noqa: BLE001 - the sweep reports every failure
                failures[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    finally:
        amp_patch.deinitialize()
    return failures


def test_torch_nn_zoo_coverage(zoo):
    total = len(zoo_specs.zoo_classes())
    runs, unexpected = 0, {}
    for level in ("O1", "O2", "O3"):
        for half_name, half in HALVES.items():
            failures = _sweep(zoo, level, half)
            runs += total - len(failures)
            print(f"\nnn zoo {level} {half_name}: {total - len(failures)}/{total} modules run "
                  f"({100.0 * (total - len(failures)) / total:.1f}%)")
            for name, why in sorted(failures.items()):
                print(f"  {name}: {why}")
                if (level, name) not in EXPECTED_FAILURES:
                    unexpected[(level, half_name, name)] = why
    coverage = 100.0 * runs / (6 * total)
    print(f"nn zoo coverage over O1/O2/O3 x fp16/bf16: {runs}/{6 * total} ({coverage:.1f}%)")
    assert coverage >= 95.0
    assert not unexpected, unexpected
