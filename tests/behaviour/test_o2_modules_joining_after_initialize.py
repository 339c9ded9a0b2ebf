"""O2 models that change after initialize: a module or param that joins the model (by a registration torch reports,
or put into ``_modules`` directly by ``insert`` or quantization's ``convert``) gets compute copies from the model's
next call on, and a training run equals, bitwise, the one whose model had it from the start."""
import sys
import threading

import pytest
import torch
from torch import nn

import amp_patch


def _o2(model, optimizer_class=torch.optim.SGD, **hyper):
    """``model`` and an optimizer of its params under O2 (bf16)."""
    optimizer = optimizer_class(model.parameters(), **hyper)
    return amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)


def test_a_module_attached_after_initialize_is_seen_at_the_next_forward():
    """The other side: registering into the model is a change, and O2 picks the new module's params up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    model, optimizer = _o2(model, lr=1e-3)
    try:
        model(torch.randn(2, 4))
        head = nn.Linear(4, 2)  # (built outside the model: its own registrations are not the model's)
        model.add_module("head", head)
        optimizer.add_param_group({"params": head.parameters()})
        out = model(torch.randn(2, 4))
        assert out.dtype is torch.float32 and head.weight.dtype is torch.float32
        out.sum().backward()
        assert head.weight.grad is not None and head.weight.grad.dtype is torch.float32
    finally:
        amp_patch.deinitialize()


def test_a_module_attached_inside_a_module_attached_after_initialize_is_seen():
    """The model's modules are taken again after each registration into it: a layer appended to a container
    that itself joined the model after initialize is part of the model too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    model, optimizer = _o2(model, lr=1e-3)
    try:
        model.append(nn.Sequential())
        model(torch.randn(2, 4))
        model[1].append(nn.Linear(4, 2))
        optimizer.add_param_group({"params": model[1].parameters()})
        out = model(torch.randn(2, 4))
        assert out.shape == (2, 2) and out.dtype is torch.float32
    finally:
        amp_patch.deinitialize()


class _Stack(nn.Module):
    def __init__(self, sequential):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4)) if sequential else nn.ModuleList([nn.Linear(4, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _insert(model):
    model.layers.insert(0, nn.Linear(4, 4))  # (torch writes _modules directly: no registration hook fires)


def _swap_in_place(model):
    model.layers._modules["0"] = nn.Linear(4, 4)  # (as torch.ao.quantization.convert swaps children)


@pytest.mark.parametrize("sequential", [True, False], ids=["Sequential", "ModuleList"])
@pytest.mark.parametrize("edit", [_insert, _swap_in_place], ids=["insert", "_modules-swap"])
def test_a_module_built_after_initialize_and_put_in_without_a_hook_is_seen_at_the_next_call(edit, sequential):
    """The model trained with the module put in after initialize equals, bitwise, the one built with it."""
    built, put_in = (_train_stack(sequential, edit, late) for late in (False, True))
    assert len(built) == len(put_in) and all(torch.equal(a, b) for a, b in zip(built, put_in))


@pytest.mark.parametrize("edit", [_insert, _swap_in_place], ids=["insert", "_modules-swap"])
def test_a_compiled_model_sees_a_module_put_in_without_a_hook(edit):
    """Only ever called compiled (dynamo cannot run the check at the call): the model's first traced call collects
    what joined it since initialize, and later registrations count at once (dynamo retraces)."""
    built, put_in = (_train_stack(False, edit, late, compiled=True) for late in (False, True))
    assert len(built) == len(put_in) and all(torch.equal(a, b) for a, b in zip(built, put_in))


def _train_stack(sequential, edit, late, compiled=False):
    torch.manual_seed(0)
    model = _Stack(sequential)
    if not late:
        edit(model)
    model, optimizer = _o2(model, lr=0.1)
    if compiled:
        torch._dynamo.reset()
    run = torch.compile(model, backend="eager") if compiled else model
    try:
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        if not compiled:
            model(x)
        if late:
            edit(model)
            optimizer.param_groups[0]["params"] = list(model.parameters())
        for _ in range(2):
            loss = run(x).float().pow(2).sum()
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        amp_patch.deinitialize()


def test_registrations_in_two_threads_while_one_grows_the_model_raise_nothing():
    """One thread builds modules outside the model while another adds modules to it: the watch walking the model
    meanwhile must not fail the builder's registration (it counts the change instead)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)]) for _ in range(10)])
    model, optimizer = _o2(model, lr=0.1)
    errors, stop = [], threading.Event()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def builder():
        try:
            while not stop.is_set():
                nn.CrossEntropyLoss()
        except Exception as exc:  # noqa: BLE001 (the test reports whatever escaped)
            errors.append(exc)

    try:
        thread = threading.Thread(target=builder)
        thread.start()
        try:
            for i in range(1500):
                model[i % 10].add_module(f"extra{i}", nn.Identity())
        finally:
            stop.set()
            thread.join()
    finally:
        sys.setswitchinterval(interval)
        amp_patch.deinitialize()
    assert errors == []


class _ConvBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 4, 1)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.conv(self.lin(x).unsqueeze(-1))).squeeze(-1)


def _fuse(model):
    torch.ao.quantization.fuse_modules(model, [["conv", "bn"]], inplace=True)


def test_fusing_modules_after_initialize_trains_as_fusing_them_before():
    """``fuse_modules`` moves the first module's pre-hooks to the fused module but drops its hooks: a call that
    counted the fused module's pre-hook and never saw its end kept the copies in place after the call (the grads
    went to the copies, the fp32 params never moved)."""
    results = []
    for late in (False, True):
        torch.manual_seed(0)
        model = _ConvBn().eval()
        if not late:
            _fuse(model)
        model, optimizer = _o2(model, lr=0.1)
        try:
            if late:
                _fuse(model)
                optimizer.param_groups[0]["params"] = list(model.parameters())
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
            for _ in range(2):
                loss = model(x).float().pow(2).sum()
                assert model.lin.weight.dtype is torch.float32  # (the call is over: the fp32 params are back)
                with amp_patch.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                optimizer.zero_grad()
            results.append([p.detach().clone() for p in model.parameters()])
        finally:
            amp_patch.deinitialize()
    before, after = results
    assert all(torch.equal(a, b) for a, b in zip(before, after))


class _Scaled(nn.Module):
    def __init__(self, reregister):
        super().__init__()
        self.reregister = reregister
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4), persistent=False)

    def forward(self, x):
        if self.reregister:  # (a new tensor each call)
            self.register_buffer("scale", torch.ones(4), persistent=False)
        return self.lin(x) * self.scale


@pytest.mark.parametrize("loss_module", ["built per step", "none"])
def test_a_compiled_model_trains_as_the_eager_one_with_registrations_every_step(loss_module):
    """Registrations while the model runs compiled (a loss module built per step in the loop, a buffer registered in
    the forward) count at once, so dynamo retraces instead of guarding on anything else: no recompile storm that
    leaves the half copies in the model (once dynamo gave up, the fp32 params were never put back)."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _Scaled(reregister=True)
        model, optimizer = _o2(model, lr=0.1)
        torch._dynamo.reset()
        run = torch.compile(model, backend="eager") if compiled else model
        try:
            for step in range(12):
                x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
                target = torch.tensor([step % 4, 1])
                if loss_module == "built per step":
                    loss = nn.CrossEntropyLoss()(run(x).float(), target)
                else:
                    loss = nn.functional.cross_entropy(run(x).float(), target)
                with amp_patch.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                optimizer.zero_grad()
                assert model.lin.weight.dtype is torch.float32
                assert any(p is model.lin.weight for g in optimizer.param_groups for p in g["params"])
            runs.append([p.detach().clone() for p in model.parameters()])
        finally:
            amp_patch.deinitialize()
    eager, compiled_run = runs
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled_run))


def test_a_forward_registering_a_new_buffer_on_every_call_keeps_no_more_each_call():
    import gc
    torch.manual_seed(0)
    model = _Scaled(reregister=True)
    model, optimizer = _o2(model, lr=0.1)
    try:
        x = torch.randn(2, 4)

        def tensors_after(calls):
            for _ in range(calls):
                model(x)
            gc.collect()
            return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))

        before = tensors_after(5)
        assert tensors_after(50) <= before + 2
    finally:
        amp_patch.deinitialize()
    assert model.scale.dtype is torch.float32


class _Net(nn.Module):
    """Lightning-style: ``training_step`` calls ``self.net``, so the fused block starts each call itself."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, x):
        return (self.net(x).float() - 1).pow(2).mean()


def test_a_fused_block_that_starts_the_call_itself_ends_it():
    """``fuse_modules_qat`` wraps Linear+ReLU in a ``LinearReLU`` that gets the Linear's pre-hook while the hook that
    ends the call stays on the inner Linear: the wrapper starting a call must end it too (before, the half copies
    stayed in the model and the loss stopped moving)."""
    results = []
    for late in (False, True):
        torch.manual_seed(0)
        model = _Net()
        fuse = torch.ao.quantization.fuse_modules_qat
        if not late:
            fuse(model.net, [["0", "1"]], inplace=True)
        model, optimizer = _o2(model, lr=0.5)
        try:
            if late:
                fuse(model.net, [["0", "1"]], inplace=True)
                optimizer.param_groups[0]["params"] = list(model.parameters())
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).bfloat16()  # (no model call casts it)
            for _ in range(3):
                loss = model.training_step(x)
                with amp_patch.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                optimizer.zero_grad()
                assert model.net[0][0].weight.dtype is torch.float32
            results.append([p.detach().clone() for p in model.parameters()])
        finally:
            amp_patch.deinitialize()
    before, after = results
    assert all(torch.equal(a, b) for a, b in zip(before, after))
