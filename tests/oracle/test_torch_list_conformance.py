"""The shipped ``torch_cpu`` / ``torch_cuda`` op lists against torch's own autocast test tables.

``torch.testing._internal.autocast_test_lists`` holds the tables torch's test suite uses to check native
autocast: each entry is an op, its arguments (and sometimes kwargs), and the dtype the op must produce. The
oracle is the same as torch's ``_run_autocast_outofplace``: under autocast, the ``module.op`` variant and the
``Tensor.op`` method variant (when ``torch.Tensor`` has it) must produce the expected dtype, agree with each
other, and be bitwise equal to a control that casts the floating-point args to the op's run-as type and calls
the op with no autocast at all.

``AutocastCPUTestLists`` is checked against ``op_lists="torch_cpu"`` with both half dtypes (as torch does);
``AutocastTestLists`` (the CUDA policy) against ``op_lists="torch_cuda"`` on CPU tensors, for every entry that
has a CPU kernel. Every entry is its own test id.
"""
import collections.abc

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("expecttest")  # autocast_test_lists imports common_utils, which needs it

from torch.testing._internal import autocast_test_lists as atl  # noqa: E402

import amp_patch  # noqa: E402

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

_rng_state = torch.random.get_rng_state()
torch.manual_seed(1234)
CPU_LISTS = atl.AutocastCPUTestLists(torch.device("cpu"))
CUDA_LISTS = atl.AutocastTestLists(torch.device("cpu"))
torch.random.set_rng_state(_rng_state)

# Entries of the CUDA table that cannot run on a CPU build at all: cudnn kernels only; the einsum entry is
# malformed (equation in the args slot, args in the ROCm-skip slot: torch's own test skips it too).
CUDA_ONLY_OPS = {"cudnn_convolution", "cudnn_convolution_transpose"}


class Case:
    def __init__(self, op, args, kwargs, module, run_as, out_type, half_dtype):
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.module = module
        self.run_as = run_as          # dtype the control casts to; None means "the half dtype"
        self.out_type = out_type      # expected dtype of tensor outputs; None means run_as
        self.half_dtype = half_dtype


def _kw(entry, i):
    return entry[i] if len(entry) > i and isinstance(entry[i], dict) else {}


def _cpu_cases():
    L = CPU_LISTS
    cases = []

    def add(list_name, idx, op, dtype_name, case):
        cases.append(pytest.param(case, id=f"{list_name}-{idx}-{op}-{dtype_name}"))

    for name, module in (("torch_expect_builtin_promote", torch), ("methods_expect_builtin_promote", None)):
        for i, (op, args_bf16, args_fp16, out_type) in enumerate(getattr(L, name)):
            add(name, i, op, "bf16", Case(op, args_bf16, {}, module, torch.float32, out_type, torch.bfloat16))
            add(name, i, op, "fp16", Case(op, args_fp16, {}, module, torch.float32, out_type, torch.float16))
    for name, module, run_as in (("torch_16", torch, None), ("nn_16", torch._C._nn, None),
                                 ("torch_fp32", torch, torch.float32), ("nn_fp32", torch._C._nn, torch.float32)):
        for i, entry in enumerate(getattr(L, name)):
            op, args, kwargs = entry[0], entry[1], _kw(entry, 2)
            for dname, dtype in HALF_DTYPES.items():
                add(name, i, op, dname, Case(op, args, kwargs, module, run_as, None, dtype))
    for i, (op, args_bf16, args_fp16) in enumerate(L.torch_need_autocast_promote):
        add("torch_need_autocast_promote", i, op, "bf16",
            Case(op, args_bf16, {}, torch, torch.float32, None, torch.bfloat16))
        add("torch_need_autocast_promote", i, op, "fp16",
            Case(op, args_fp16, {}, torch, torch.float32, None, torch.float16))
    return cases


def _cuda_cases():
    L = CUDA_LISTS
    cases = []

    def add(list_name, idx, op, dtype_name, case):
        cases.append(pytest.param(case, id=f"{list_name}-{idx}-{op}-{dtype_name}"))

    for name, module in (("torch_expect_builtin_promote", torch), ("methods_expect_builtin_promote", None)):
        for i, (op, args, out_type) in enumerate(getattr(L, name)):
            add(name, i, op, "fp16", Case(op, args, {}, module, torch.float32, out_type, torch.float16))
    # lower-precision lists: the table's dtype (fp16) and, as torch's own bf16 variant of the test does, bf16
    for name, module in (("torch_fp16", torch), ("nn_fp16", torch._C._nn), ("linalg_fp16", torch._C._linalg),
                         ("methods_fp16", None)):
        for i, entry in enumerate(getattr(L, name)):
            op, args = entry[0], entry[1]
            if op in CUDA_ONLY_OPS or isinstance(args, str):
                continue
            for dname, dtype in HALF_DTYPES.items():
                add(name, i, op, dname, Case(op, args, {}, module, None, None, dtype))
    for name, module in (("torch_fp32", torch), ("nn_fp32", torch._C._nn), ("methods_fp32", None),
                         ("torch_need_autocast_promote", torch)):
        for i, entry in enumerate(getattr(L, name)):
            op, args, kwargs = entry[0], entry[1], _kw(entry, 2)
            add(name, i, op, "fp16", Case(op, args, kwargs, module, torch.float32, None, torch.float16))
    return cases


def _cast(val, to_type):
    if isinstance(val, torch.Tensor):
        return val.to(to_type) if val.is_floating_point() else val
    if isinstance(val, (list, tuple)):
        return type(val)(_cast(v, to_type) for v in val)
    return val


def _same(first, second):
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and first.dtype == second.dtype and torch.equal(first, second)
    if isinstance(first, collections.abc.Iterable) and not isinstance(first, str):
        first, second = list(first), list(second)
        return len(first) == len(second) and all(_same(f, s) for f, s in zip(first, second))
    return first == second


def _check_dtypes(result, out_type, what):
    tensors = [result] if isinstance(result, torch.Tensor) else []
    if isinstance(result, torch.Tensor):
        assert result.dtype == out_type, f"{what} produced {result.dtype}, expected {out_type}"
    return tensors


def _run(case, region):
    """One oracle check; ``region()`` returns the context manager that turns casting on."""
    op, args, kwargs, module = case.op, case.args, case.kwargs, case.module
    run_as = case.run_as if case.run_as is not None else case.half_dtype
    out_type = case.out_type if case.out_type is not None else run_as

    output = output_method = None
    with region():
        if module is not None and hasattr(module, op):
            output = getattr(module, op)(*args, **kwargs)
        if hasattr(torch.Tensor, op):
            output_method = getattr(args[0], op)(*args[1:], **kwargs)
    assert output is not None or output_method is not None, (
        f"{op} is neither an attribute of {module} nor a Tensor method")
    mod_name = getattr(module, "__name__", "torch.Tensor")
    _check_dtypes(output, out_type, f"{mod_name}.{op}")
    _check_dtypes(output_method, out_type, f"Tensor.{op}")
    if output is not None and output_method is not None:
        assert type(output) is type(output_method)
        assert _same(output, output_method), f"{mod_name}.{op} and Tensor.{op} disagree"

    to_compare = output if output is not None else output_method
    if module is not None and hasattr(module, op):
        control = getattr(module, op)(*_cast(args, run_as), **kwargs)
    else:
        control = getattr(args[0].to(run_as), op)(*_cast(args[1:], run_as), **kwargs)
    assert type(to_compare) is type(control)
    assert _same(to_compare, control), f"{op} result does not match the cast-then-call control"


@pytest.mark.parametrize("case", _cpu_cases())
def test_torch_cpu_matches_autocast_cpu_test_lists(case):
    _run(case, lambda: amp_patch.autocast(op_lists="torch_cpu", half_dtype=case.half_dtype))


@pytest.mark.parametrize("case", _cpu_cases())
def test_oracle_sanity_native_cpu_autocast(case):
    """The oracle itself: native CPU autocast passes it (so a failure above is amp_patch's, not the harness's)."""
    _run(case, lambda: torch.autocast("cpu", dtype=case.half_dtype))


@pytest.mark.parametrize("case", _cuda_cases())
def test_torch_cuda_matches_autocast_test_lists(case):
    _run(case, lambda: amp_patch.autocast(op_lists="torch_cuda", half_dtype=case.half_dtype))


@pytest.mark.parametrize("entry", CUDA_LISTS.banned, ids=lambda e: e[0])
def test_torch_cuda_banned(entry):
    op, args, module = entry
    with amp_patch.autocast(op_lists="torch_cuda", half_dtype=torch.float16):
        with pytest.raises(amp_patch.BannedOpError) as info:
            getattr(module, op)(*args)
    message = str(info.value)
    assert "binary_cross_entropy_with_logits" in message and "BCEWithLogitsLoss" in message


def test_torch_cuda_einsum_is_half():
    """The table's einsum entry is malformed (see CUDA_ONLY_OPS); check the op it meant to cover."""
    a = torch.randn(2, 3, 4, 5)
    b = torch.randn(2, 6, 4, 5)
    with amp_patch.autocast(op_lists="torch_cuda", half_dtype=torch.bfloat16):
        out = torch.einsum("bkhd,bqhd->bqkh", a, b)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.einsum("bkhd,bqhd->bqkh", a.bfloat16(), b.bfloat16()))


# Python entry points through which each registered aten op can be reached; an op of the native policy must
# be listed on at least one of them. Ops with no Python binding at all are exempt.
_NO_PYTHON_BINDING = {"multilabel_margin_loss_forward", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell"}


# Ops every CUDA build registers for AutocastCUDA and a CPU build cannot (cuDNN's RNN, registered beside the cuDNN
# kernels): seen on the 2.11.0+cu130, 2.14.1+cu130 and 2.15.0+cu132 builds, absent from 2.13.0+cpu's registrations.
CUDA_BUILD_ONLY = {"_cudnn_rnn"}
# Python entry points of ops that torch reaches from inside its own C++ (nn.LSTM -> torch._VF.lstm -> _cudnn_rnn)
_REACHED_THROUGH = {"_cudnn_rnn": {("torch._VF", n) for n in ("lstm", "gru", "rnn_tanh", "rnn_relu")}}
_CUDA_TABLES = ("torch_fp16", "nn_fp16", "linalg_fp16", "methods_fp16", "torch_fp32", "nn_fp32", "methods_fp32",
                "torch_need_autocast_promote", "banned")


def _policy_ops(dispatch_key):
    """The ops of native autocast's policy for ``dispatch_key``. For CUDA: this build's registrations, the ops of
    torch's own CUDA test tables and the CUDA-build-only registrations, so a CPU build checks what a GPU runs."""
    ops = {r.split("::", 1)[1].split(".")[0]
           for r in torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)}
    if dispatch_key == "AutocastCUDA":
        ops |= CUDA_BUILD_ONLY | {entry[0] for name in _CUDA_TABLES for entry in getattr(CUDA_LISTS, name)}
    return ops


def _candidate_entries(base):
    cands = {("torch", base), ("torch.Tensor", base), ("torch.nn.functional", base), ("torch._C._nn", base)}
    cands |= _REACHED_THROUGH.get(base, set())
    if base.startswith("linalg_"):
        cands |= {("torch._C._linalg", base), ("torch.linalg", base[len("linalg_"):])}
    if base.startswith("fft_"):
        cands.add(("torch.fft", base[len("fft_"):]))
    return cands


@pytest.mark.parametrize("list_name, dispatch_key", [("torch_cpu", "AutocastCPU"), ("torch_cuda", "AutocastCUDA")])
def test_every_registered_autocast_op_is_listed(list_name, dispatch_key):
    table = amp_patch.load_op_lists(list_name)
    listed = {(e.target, e.name) for e in table.entries}
    missing = sorted(op for op in _policy_ops(dispatch_key) - _NO_PYTHON_BINDING
                     if not (_candidate_entries(op) & listed))
    assert not missing, f"{list_name} lacks the aten ops {missing}"



# Python names of entries that differ from their aten op's (the other direction of _candidate_entries)
_ENTRY_OPS = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}
_TARGET_PREFIXES = {"torch.linalg": "linalg_", "torch.fft": "fft_", "torch.special": "special_"}


def _entries_without_note(list_name):
    """``(category, target, name)`` of every entry of a shipped list that has no ``note`` (read as data)."""
    import yaml

    from amp_patch.config.oplist import _shipped_dir

    doc = yaml.safe_load((_shipped_dir() / f"{list_name}.yaml").read_text())
    for category in ("half", "float", "promote", "sequence_promote", "banned"):
        for target, entries in (doc.get(category) or {}).items():
            for entry in entries:
                if isinstance(entry, str) or "note" not in entry:
                    yield category, target, entry if isinstance(entry, str) else entry["name"]


def _aten_name(target, name):
    prefix = _TARGET_PREFIXES.get(target, "")
    return _ENTRY_OPS.get(name, name if name.startswith(prefix) else prefix + name)


@pytest.mark.parametrize("list_name, dispatch_key", [("torch_cpu", "AutocastCPU"), ("torch_cuda", "AutocastCUDA")])
def test_every_entry_without_a_note_is_a_registered_autocast_op(list_name, dispatch_key):
    """The other direction: an entry stands for an op of native's policy, or its ``note`` says why it is there
    (an alias, a C++ composite native casts inside, an entry point torch calls from C++)."""
    policy = _policy_ops(dispatch_key)
    extra = sorted((c, t, n) for c, t, n in _entries_without_note(list_name) if _aten_name(t, n) not in policy)
    assert not extra, f"{list_name} lists ops native autocast does not register, without a note: {extra}"

def _entry_point_cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    target = torch.zeros(4, dtype=torch.long)
    cell = torch.nn.LSTMCell(4, 5)
    return {
        # (op list, half dtype, call, expected dtype)
        "cuda-LSTMCell-via-_VF": ("torch_cuda", torch.float16, lambda: cell(r(3, 4))[0], torch.float16),
        "cuda-interpolate-via-_C._nn": ("torch_cuda", torch.float16,
                                        lambda: F.interpolate(r(1, 2, 4, 4, dtype=torch.float16), scale_factor=2,
                                                              mode="bilinear"), torch.float32),
        "cuda-cross_entropy-composite": ("torch_cuda", torch.float16,
                                         lambda: F.cross_entropy(r(4, 3, dtype=torch.float16), target), torch.float32),
        "cuda-nll_loss": ("torch_cuda", torch.float16,
                          lambda: F.nll_loss(r(4, 3, dtype=torch.float16), target), torch.float32),
        "cuda-linalg.norm-composite": ("torch_cuda", torch.float16,
                                       lambda: torch.linalg.norm(r(4, dtype=torch.float16)), torch.float32),
        "cuda-Tensor.norm": ("torch_cuda", torch.float16, lambda: r(4, dtype=torch.float16).norm(), torch.float32),
        "cuda-rmatmul": ("torch_cuda", torch.bfloat16, lambda: r(3, 3).__rmatmul__(r(3, 3)), torch.bfloat16),
        "cuda-linalg.matmul-alias": ("torch_cuda", torch.bfloat16, lambda: torch.linalg.matmul(r(3, 3), r(3, 3)),
                                     torch.bfloat16),
        "cuda-cat-builtin-promote": ("torch_cuda", torch.float16,
                                     lambda: torch.cat([r(2, dtype=torch.float16), r(2)]), torch.float32),
        "cpu-cross_entropy": ("torch_cpu", torch.bfloat16,
                              lambda: F.cross_entropy(r(4, 3, dtype=torch.bfloat16), target), torch.float32),
        "cpu-nll_loss-composite": ("torch_cpu", torch.bfloat16,
                                   lambda: F.nll_loss(r(4, 3, dtype=torch.bfloat16), target), torch.float32),
        "cpu-Linear-module": ("torch_cpu", torch.bfloat16, lambda: torch.nn.Linear(4, 2)(r(3, 4)), torch.bfloat16),
        "cpu-softmax-not-listed": ("torch_cpu", torch.bfloat16,
                                   lambda: F.softmax(r(4, dtype=torch.bfloat16), 0), torch.bfloat16),
        "cpu-fft": ("torch_cpu", torch.bfloat16, lambda: torch.fft.rfft(r(8, dtype=torch.bfloat16)).real,
                    torch.float32),
    }



@pytest.mark.parametrize("name", sorted(_entry_point_cases()))
def test_python_entry_points_follow_native_policy(name):
    """Entry points other than the tables' own: modules, F wrappers, _VF, aliases and composites."""
    op_lists, half_dtype, call, expected = _entry_point_cases()[name]
    with amp_patch.autocast(op_lists=op_lists, half_dtype=half_dtype):
        out = call()
    assert out.dtype == expected
