"""O2's compute copies are the state of one call in one thread: code of the call that runs outside its extent
re-enters it, and nothing outside the call sees them.

Each case runs the same program under O2 (bfloat16) and under the hand-made reference (every param outside
batchnorm cast once, ``p.to(bf16)``, the copies in the module for the forward and the backward, inputs cast to
bf16, outputs to fp32): outputs and fp32 grads agree **bitwise**. Cases: a checkpointed
``nn.TransformerEncoderLayer`` (reentrant, not, and selectively) and the same layer called on its own with a bf16
input; a checkpointed method reading a root param; a recursive forward; a generator forward reading a root param in its
body. Threads, with the interleaving forced by ``threading.Event`` barriers: a training thread clipping
``model.parameters()`` while a background evaluation thread is inside a call; two threads inside calls at once; a
forward running branches in a thread pool; ``deinitialize()`` from another thread before and during a call.
"""
import contextlib
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

import amp_patch

HALF = torch.bfloat16


@contextlib.contextmanager
def hand_o2(model):
    """The reference: each param cast once, the copies in the module until the block ends (forward and backward)."""
    swapped, copies = [], {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = copies.setdefault(id(p), p.to(HALF))
                swapped.append((module, name, p))
    try:
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def _fp32(out):
    return out.float() if isinstance(out, torch.Tensor) else [o.float() for o in out]


def _run_reference(model, x, call=None):
    with hand_o2(model):
        out = _fp32((call or model)(x.to(HALF)))
        loss = sum(o.sum() for o in (out if isinstance(out, list) else [out]))
        loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _run_o2(model, x, call=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
    try:
        out = (call or model)(x)
        out = list(out) if not isinstance(out, torch.Tensor) else out
        loss = sum(o.sum() for o in (out if isinstance(out, list) else [out]))
        loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        amp_patch.deinitialize()


def _same(build, x, call_o2=None, call_ref=None):
    torch.manual_seed(0)
    ref_model = build()
    torch.manual_seed(0)
    o2_model = build()
    ref_out, ref_grads = _run_reference(ref_model, x, call_ref and call_ref(ref_model))
    out, grads = _run_o2(o2_model, x, call_o2 and call_o2(o2_model))
    outs, ref_outs = (out if isinstance(out, list) else [out]), (ref_out if isinstance(ref_out, list) else [ref_out])
    assert [o.dtype for o in outs] == [torch.float32] * len(outs)
    for o, r in zip(outs, ref_outs):
        assert torch.equal(o, r)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert grads[name].dtype is torch.float32
        assert torch.equal(grads[name], ref_grads[name]), name


class CheckpointedEncoder(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.reentrant = reentrant

    def forward(self, x):
        return ckpt.checkpoint(self.layer, self.inp(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_transformer_encoder_layer(reentrant):
    _same(lambda: CheckpointedEncoder(reentrant), torch.randn(2, 5, 8, requires_grad=reentrant))


def test_transformer_encoder_layer_called_on_its_own_with_half_input():
    torch.manual_seed(0)
    model = CheckpointedEncoder(False)
    x = torch.randn(2, 5, 16)
    with hand_o2(model):
        expected = model.layer(x.to(HALF))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
    try:
        out = model.layer(x.to(HALF))
        assert out.dtype is HALF and torch.equal(out, expected)
        assert model.layer.linear1.weight.dtype is torch.float32  # only the call saw the copies
    finally:
        amp_patch.deinitialize()


class CheckpointedMethod(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.head = nn.Linear(8, 4)
        self.reentrant = reentrant

    def block(self, h):
        return torch.tanh(h @ self.w) @ self.w

    def forward(self, x):
        return self.head(ckpt.checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_method_reading_a_root_param(reentrant):
    _same(lambda: CheckpointedMethod(reentrant), torch.randn(3, 8, requires_grad=reentrant))


def _save_matmuls(ctx, op, *args, **kwargs):
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return ckpt.CheckpointPolicy.MUST_SAVE if op in saved else ckpt.CheckpointPolicy.PREFER_RECOMPUTE


class SelectivelyCheckpointed(nn.Module):
    """Selective activation checkpointing: the recomputation replays the forward's ops through a dispatch mode, so
    the re-entered call's casts must not show there (torch's "encountered during backward but not found in
    storage")."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.w = nn.Parameter(torch.randn(16, 16) * 0.3)

    def forward(self, x):
        context = functools.partial(ckpt.create_selective_checkpoint_contexts, _save_matmuls)
        h = ckpt.checkpoint(self.layer, self.inp(x), use_reentrant=False, context_fn=context)
        return ckpt.checkpoint(lambda t: torch.tanh(t @ self.w) @ self.w, h, use_reentrant=False, context_fn=context)


def test_selectively_checkpointed_layer_and_method():
    _same(SelectivelyCheckpointed, torch.randn(2, 5, 8))


class Recursive(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, depth=2):
        inner = self(x, depth - 1) if depth else x  # the inner call's output feeds the outer call's weights
        return torch.tanh(self.lin(inner))


def test_recursive_forward():
    _same(Recursive, torch.randn(3, 8))


def test_recursive_forward_under_o3_gets_half_inside():
    model = Recursive()
    seen = []
    model.lin.register_forward_hook(lambda m, a, out: seen.append(a[0].dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp_patch.initialize(model, opt, opt_level="O3", half_dtype=HALF, verbosity=0)
    try:
        out = model(torch.randn(3, 8))
    finally:
        amp_patch.deinitialize()
    assert out.dtype is torch.float32 and seen == [HALF] * 3


class Generating(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.lin(x) @ self.w)
            yield x


def test_generator_forward_reading_a_root_param():
    _same(Generating, torch.randn(3, 8))


class Evaluated(nn.Module):
    """Its forward waits (in a forward pre-hook of the inner layer) on barriers the test sets."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
        self.barriers = None

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _pause_inside(model):
    """A forward pre-hook on ``model.b`` that, in a thread named 'eval', signals ``inside`` and waits for ``go``."""
    inside, go = threading.Event(), threading.Event()

    def hook(module, args):
        if threading.current_thread().name == "eval":
            inside.set()
            assert go.wait(30)
    model.b.register_forward_pre_hook(hook)
    return inside, go


def _thread(target):
    result = {}

    def run():
        try:
            result["value"] = target()
        except BaseException as exc:  # noqa: B036 - reported in the main thread
            result["error"] = exc
    thread = threading.Thread(target=run, name="eval")
    thread.start()
    return thread, result


def test_training_thread_clips_fp32_grads_while_an_evaluation_thread_is_inside_a_call():
    torch.manual_seed(0)
    model = Evaluated()
    x = torch.randn(4, 8)
    reference = Evaluated()
    reference.load_state_dict(model.state_dict())
    with hand_o2(reference):
        reference(x.to(HALF)).float().pow(2).sum().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    inside, go = _pause_inside(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
    try:
        model(x).pow(2).sum().backward()
        with torch.no_grad():
            thread, result = _thread(lambda: model(x))
            assert inside.wait(30)
            params = list(model.parameters())  # the eval thread's copies are its own
            norm = torch.nn.utils.clip_grad_norm_(params, 0.1)
            go.set()
            thread.join(30)
        assert "error" not in result, result
        assert [p.dtype for p in params] == [torch.float32] * 4
        assert all(p.grad is not None for p in params)
        assert torch.equal(norm, expected_norm)
        for p, r in zip(params, reference.parameters()):
            assert torch.equal(p.grad, r.grad)
        assert result["value"].dtype is torch.float32
    finally:
        go.set()
        amp_patch.deinitialize()


def test_two_threads_inside_calls_at_once():
    torch.manual_seed(0)
    model = Evaluated()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad(), hand_o2(model):
        expected_x, expected_y = model(x.to(HALF)).float(), model(y.to(HALF)).float()
    inside, go = _pause_inside(model)
    model = amp_patch.initialize(model, opt_level="O2", half_dtype=HALF, verbosity=0)
    try:
        with torch.no_grad():
            thread, result = _thread(lambda: model(x))
            assert inside.wait(30)
            out_y = model(y)  # runs to the end while the other thread is inside its call
            go.set()
            thread.join(30)
        assert "error" not in result, result
        assert torch.equal(out_y, expected_y) and torch.equal(result["value"], expected_x)
    finally:
        go.set()
        amp_patch.deinitialize()


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda branch: branch(x), self.branches))
        return sum(outs)


def test_forward_running_branches_in_a_thread_pool():
    _same(Branches, torch.randn(3, 8))


def test_deinitialize_from_another_thread_during_a_call_is_refused():
    model = Evaluated()
    inside, go = _pause_inside(model)
    model = amp_patch.initialize(model, opt_level="O2", half_dtype=HALF, verbosity=0)
    try:
        with torch.no_grad():
            thread, result = _thread(lambda: model(torch.randn(2, 8)))
            assert inside.wait(30)
            with pytest.raises(amp_patch.UsageError, match="inside a call of the O2 Evaluated.*join"):
                amp_patch.deinitialize()
            go.set()
            thread.join(30)
        assert "error" not in result and result["value"].dtype is torch.float32
    finally:
        go.set()
        amp_patch.deinitialize()


def test_deinitialize_between_a_calls_hook_snapshot_and_its_hooks():
    """torch snapshots a module's hooks when its call starts: a deinitialize() from another thread right then
    leaves the call running removed hooks, which must be inert (no raw TypeError, no copy left behind)."""
    torch.manual_seed(0)
    model = Evaluated()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    started, go = threading.Event(), threading.Event()

    def global_pre_hook(module, args):
        if module is model and threading.current_thread().name == "eval":
            started.set()
            assert go.wait(30)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(global_pre_hook)
    amp_patch.initialize(model, opt_level="O2", half_dtype=HALF, verbosity=0)
    try:
        with torch.no_grad():
            thread, result = _thread(lambda: model(x))
            assert started.wait(30)
            amp_patch.deinitialize()
            go.set()
            thread.join(30)
        assert "error" not in result, result
        assert torch.equal(result["value"], expected)  # fp32, as the model now is
        assert all(p.dtype is torch.float32 for p in model.parameters())
        assert type(model.a._parameters) is dict
    finally:
        go.set()
        handle.remove()
        amp_patch.deinitialize()
