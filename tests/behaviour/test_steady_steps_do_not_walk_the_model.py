"""Once training is under way, a step costs amp_patch no walk over the model's modules: what it collected at
initialize (O2's weight slots, the dtype check of the model's params) is collected again only when something is
registered into the model. Real architectures register modules of their own on every call (HF models build
``CrossEntropyLoss()`` inside ``forward``, which registers its ``weight`` buffer); that is no change to the model.
The walks are counted, not timed: a walk of a model is ``Module.named_modules`` called from amp_patch's code."""
import sys

import pytest
import torch
from torch import nn

import amp_patch
from tests import zoo

MODELS = ["gpt2-eager", "bert-eager", "t5-eager", "llama-sdpa", "vit-sdpa", "whisper-eager", "encoder",
          "transformer", "resnet", "lstm-seq2seq"]


@pytest.fixture
def walks(monkeypatch):
    """``walks()``: how many walks of a model amp_patch's code started since the last call."""
    counted = [0]
    original = nn.Module.named_modules

    def named_modules(self, *args, **kwargs):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "named_modules":  # (its recursion into the children: the same walk)
            return original(self, *args, **kwargs)
        while caller is not None and caller.f_code.co_filename.endswith("torch/nn/modules/module.py"):
            caller = caller.f_back  # (modules(), named_parameters() and the like)
        if caller is not None and "amp_patch" in caller.f_code.co_filename.replace("\\", "/").split("/")[-3:-1]:
            counted[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", named_modules)

    def take():
        found, counted[0] = counted[0], 0
        return found
    return take


def _steps(case, model, optimizer, batches):
    for batch in batches:
        loss = case.loss_fn(zoo._call(model, batch), batch).float()
        with amp_patch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", MODELS)
def test_a_steady_step_of_a_real_architecture_walks_no_module(name, level, walks):
    case = zoo._build(name)
    optimizer = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(case.model, optimizer, opt_level=level, half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        batches = zoo._batches(case, 3)
        _steps(case, model, optimizer, batches[:1])  # (the first step's one-time checks may walk)
        walks()
        _steps(case, model, optimizer, batches[1:])
        assert walks() == 0
    finally:
        amp_patch.deinitialize()


def test_a_module_attached_after_initialize_is_still_seen_at_the_next_forward(walks):
    """The other side: registering into the model is a change, and O2 picks the new module's params up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        model(torch.randn(2, 4))
        head = nn.Linear(4, 2)  # (built outside the model: its own registrations are not the model's)
        model.add_module("head", head)
        optimizer.add_param_group({"params": head.parameters()})
        out = model(torch.randn(2, 4))
        assert out.dtype is torch.float32 and head.weight.dtype is torch.float32
        assert walks() > 0
        out.sum().backward()
        assert head.weight.grad is not None and head.weight.grad.dtype is torch.float32
    finally:
        amp_patch.deinitialize()


def test_a_module_attached_inside_a_module_attached_after_initialize_is_seen():
    """The model's modules are taken again after each registration into it: a layer appended to a container
    that itself joined the model after initialize is part of the model too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        model.append(nn.Sequential())
        model(torch.randn(2, 4))
        model[1].append(nn.Linear(4, 2))
        optimizer.add_param_group({"params": model[1].parameters()})
        out = model(torch.randn(2, 4))
        assert out.shape == (2, 2) and out.dtype is torch.float32
    finally:
        amp_patch.deinitialize()


class _Rotary(nn.Module):
    """A rotary embedding of HF's ``longrope`` / ``dynamic`` kinds: it registers its ``inv_freq`` again in forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.proj = nn.Linear(4, 4)

        self.seen = []  # the buffer's dtype as each call starts

    def forward(self, x):
        self.seen.append(self.inv_freq.dtype)
        self.register_buffer("inv_freq", torch.arange(4.0) / 4, persistent=False)
        return self.proj(x) * self.inv_freq


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_buffer_registered_in_every_forward_walks_no_module_and_is_cast_as_before(level, walks):
    torch.manual_seed(0)
    model = _Rotary()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        for step in range(4):
            if step == 2:
                walks()
            loss = model(torch.randn(2, 4)).float().sum()
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert walks() == 0
    finally:
        amp_patch.deinitialize()
    # O2 gives a buffer registered after initialize the half dtype at the next call (O3 leaves it as registered)
    assert model.seen[1:] == [torch.bfloat16 if level == "O2" else torch.float32] * 3
    assert model.inv_freq.dtype is torch.float32


@pytest.mark.parametrize("built", ["before the call", "after the call"])
def test_a_loss_module_built_on_every_step_costs_at_most_a_membership_walk(built, walks):
    """A script building its loss module per step (its ``weight`` buffer is registered into a module outside the
    model): built after the model's call, it is gone by the next call and costs nothing; built before it
    (``nn.CrossEntropyLoss()(model(x), y)`` builds the module first), it is alive at the call, which walks the
    model once to see that it is not part of it. Neither collects the model's slots or checks its dtypes again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                            verbosity=0)
    try:
        for step in range(4):
            if step == 1:
                walks()
            if built == "before the call":
                loss = nn.CrossEntropyLoss()(model(torch.randn(2, 4)), torch.tensor([0, 2]))
            else:
                out = model(torch.randn(2, 4))
                loss = nn.CrossEntropyLoss()(out, torch.tensor([0, 2]))
            with amp_patch.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert walks() <= (3 if built == "before the call" else 0)
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
    results = []
    for late in (False, True):
        torch.manual_seed(0)
        model = _Stack(sequential)
        if not late:
            edit(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                                verbosity=0)
        try:
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
            model(x)
            if late:
                edit(model)
                optimizer.param_groups[0]["params"] = list(model.parameters())
            for _ in range(2):
                loss = model(x).float().pow(2).sum()
                with amp_patch.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
                optimizer.zero_grad()
            results.append([p.detach().clone() for p in model.parameters()])
        finally:
            amp_patch.deinitialize()
    built, put_in = results
    assert len(built) == len(put_in) and all(torch.equal(a, b) for a, b in zip(built, put_in))


def test_registrations_in_two_threads_while_one_grows_the_model_raise_nothing():
    """One thread builds modules outside the model while another adds modules to it: the watch walking the model
    meanwhile must not fail the builder's registration (it counts the change instead)."""
    import threading
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)]) for _ in range(10)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2", half_dtype=torch.bfloat16,
                                            verbosity=0)
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
