"""O2 has one owner of the weights: the model's fp32 params. Seeded random programs over who touches them.

Each program is drawn from a seed: an optimizer (SGD, Adam, LBFGS stepped with a closure, a SAM-style optimizer
whose closure re-runs the forward at perturbed weights, a wrapper that steps an inner optimizer built at its
construction as ZeroRedundancyOptimizer does), an AveragedModel (EMA) of the model, and a sequence of operations:
steps (with and without clipping ``model.parameters()``), ``load_state_dict`` of the model, of a submodule and with
``strict=False``, ``requires_grad`` toggles with ``add_param_group``, in-place edits (WGAN clipping), deepcopies,
``state_dict()`` checks and ``deinitialize()`` at any point, a step during which a forward pre-hook clamps a
weight in place, a step while another thread evaluates the model. A second model shares the first one's first layer.

The program runs twice: under O2 (bfloat16) and in plain fp32. After every operation the two runs' values agree:
values that no step changed since they were last set exactly (loaded, frozen, never trained, edited the same way)
**bitwise**, the others within half-precision tolerance of the training (``_close``: the O2 run's drift from the
fp32 run stays under 15% of the distance the fp32 run travelled since the two last agreed, plus 2e-3; 60% for
LBFGS, which bf16 gradients move as much under native autocast). A stale
copy (the weights never move, a closure that sees the old weights, a load that does not arrive) breaks one of the
two.

Also: O2 training is bitwise the same as fp32 params trained under native ``torch.autocast(bfloat16)`` where the
policy is the same (linear layers and tanh, all in bf16); a plain ``loss.backward()`` trains; O3 takes an
optimizer whose state is already fp32.
"""
import copy
import logging
import random
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel

import amp_patch

HALF = torch.bfloat16
PROGRAMS = 40
# LBFGS's direction comes from differences of gradients: bf16 grads move it as much under native
# torch.autocast(bfloat16) (about 50% of one step's travel from the fp32 run, in program 7)
TOLERANCE = {"sgd": 0.15, "adam": 0.15, "sam": 0.15, "wrapper": 0.15, "lbfgs": 0.6}
OPS = ("step", "step", "step", "step_clip", "load_model", "load_sub", "load_partial", "freeze_toggle",
       "add_group", "edit", "deepcopy", "state_dict", "ema", "step_constrained", "step_beside_eval_thread")


class Wrapper(torch.optim.Optimizer):
    """Steps an inner optimizer built at construction over the same param objects (ZeroRedundancyOptimizer)."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.inner = torch.optim.SGD([p for g in self.param_groups for p in g["params"]], lr=lr, momentum=0.5)

    def step(self, closure=None):
        return self.inner.step(closure)

    def add_param_group(self, group):
        super().add_param_group(group)
        if hasattr(self, "inner"):
            self.inner.add_param_group({"params": group["params"]})


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation (davda54/sam's shape): the closure's forward must see the perturbed weights."""

    def __init__(self, params, lr, rho=0.05):
        super().__init__(params, dict(lr=lr, rho=rho))
        self.base = torch.optim.SGD(self.param_groups, lr=lr)

    @torch.no_grad()
    def step(self, closure):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([g.norm() for g in grads])) + 1e-12 if grads else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * (group["rho"] / norm))
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.data = self.state[p].pop("old_p")  # davda54/sam's second_step: back exactly
        self.base.step()


def _models(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    other = torch.nn.Sequential(model[0], torch.nn.Linear(6, 2))  # shares model's first layer
    return model, other


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if kind == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.2, max_iter=3, history_size=3)
    if kind == "sam":
        return SAM(params, lr=0.1)
    return Wrapper(params, lr=0.1)


def _constrain(module, args):
    with torch.no_grad():
        module.weight.clamp_(-0.2, 0.2)


def _evaluate(model, stop):
    x = torch.randn(3, 4)
    while not stop.is_set():
        with torch.no_grad():
            model(x)


class Run:
    """One execution of a program (``amp``: under O2 bf16; else plain fp32)."""

    def __init__(self, seed, kind, amp):
        self.amp, self.kind = amp, kind
        self.model, self.other = _models(seed)
        self.model[2].bias.requires_grad_(False)  # frozen at initialize, added to the optimizer later maybe
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = _optimizer(kind, params)
        self.added = False
        if amp:
            amp_patch.initialize([self.model, self.other], self.opt, opt_level="O2", half_dtype=HALF,
                                 verbosity=0)
        self.ema = AveragedModel(self.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        self.live = amp
        self.copies = []
        gen = torch.Generator().manual_seed(seed + 1000)
        self.data = [(torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)) for _ in range(4)]
        self.steps = 0

    def loss(self):
        x, y = self.data[self.steps % len(self.data)]
        return F.mse_loss(self.model(x).float(), y) + 0.1 * self.other(x).float().pow(2).mean()

    def backward(self, loss):
        if self.live:
            with amp_patch.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
        else:
            loss.backward()

    def step(self, clip=False):
        self.opt.zero_grad()
        if self.kind in ("lbfgs", "sam"):
            def closure():
                self.opt.zero_grad()
                loss = self.loss()
                self.backward(loss)
                return loss
            if self.kind == "sam":
                closure()
            self.opt.step(closure)
        else:
            self.backward(self.loss())
            if clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.05)
            self.opt.step()
        self.steps += 1

    def apply(self, op, arg):
        if op in ("step", "step_clip"):
            self.step(clip=op == "step_clip")
        elif op == "load_model":
            self.model.load_state_dict(arg)
        elif op == "load_sub":
            self.model[2].load_state_dict({k[2:]: v for k, v in arg.items() if k.startswith("2.")})
        elif op == "load_partial":
            self.model.load_state_dict({"0.weight": arg["0.weight"]}, strict=False)
        elif op == "freeze_toggle":
            self.model[0].bias.requires_grad_(not self.model[0].bias.requires_grad)
        elif op == "add_group" and not self.added:
            self.added = True
            self.model[2].bias.requires_grad_(True)
            self.opt.add_param_group({"params": [self.model[2].bias]})
        elif op == "step_constrained":  # a forward pre-hook edits a weight in place during the call
            handle = self.model[2].register_forward_pre_hook(_constrain)
            try:
                self.step()
            finally:
                handle.remove()
        elif op == "step_beside_eval_thread":  # another thread evaluates the model during the step
            stop = threading.Event()
            thread = threading.Thread(target=_evaluate, args=(self.model, stop))
            thread.start()
            try:
                self.step()
            finally:
                stop.set()
                thread.join()
        elif op == "edit":
            for p in self.model.parameters():
                p.data.clamp_(-0.3, 0.3)
        elif op == "deepcopy":
            self.copies.append(copy.deepcopy(self.model))
        elif op == "ema":
            self.ema.update_parameters(self.model)
        elif op == "deinit" and self.live:
            amp_patch.deinitialize()
            self.live = False

    def values(self):
        """Every value the program can read: the models' state_dicts, the EMA's, the copies', the optimizer's."""
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        out.update({f"other.{k}": v for k, v in self.other.state_dict().items()})
        out.update({f"ema.{k}": v for k, v in self.ema.module.state_dict().items()})
        for i, c in enumerate(self.copies):
            out.update({f"copy{i}.{k}": v for k, v in c.state_dict().items()})
        params = [p for g in self.opt.param_groups for p in g["params"]]
        out.update({f"opt.param{i}": p for i, p in enumerate(params)})
        return {k: v.detach().clone() for k, v in out.items()}


def _program(seed):
    rng = random.Random(seed)
    kind = rng.choice(("sgd", "adam", "lbfgs", "sam", "wrapper"))
    ops = [rng.choice(OPS) for _ in range(rng.randint(4, 9))]
    if rng.random() < 0.4:
        ops.insert(rng.randint(0, len(ops)), "deinit")
    torch.manual_seed(seed + 7)
    load = {k: torch.randn_like(v) * 0.3 for k, v in _models(0)[0].state_dict().items()}
    return kind, ops, load


def run_program(seed):
    kind, ops, load = _program(seed)
    traces = []
    for amp in (True, False):
        run = Run(seed, kind, amp)
        trace = [run.values()]
        for op in ops:
            run.apply(op, load)
            trace.append(run.values())
        if run.live:
            amp_patch.deinitialize()
        traces.append(trace)
    amp_trace, fp32_trace = traces
    for i, (got, want) in enumerate(zip(amp_trace, fp32_trace)):
        where = f"program {seed} ({kind}: {ops}) after op {i} ({(['start'] + ops)[i]})"
        assert got.keys() == want.keys(), where
        for name in want:
            assert got[name].dtype == want[name].dtype, f"{where}: {name} is {got[name].dtype}"
            if torch.equal(got[name], want[name]):
                continue
            start = _last_equal(amp_trace, fp32_trace, i, name)
            assert not torch.equal(start, want[name]), f"{where}: {name} changed, but no op changed it in fp32"
            assert _close(got[name], want[name], start, TOLERANCE[kind]), (
                f"{where}: {name} differs by {(got[name].float() - want[name].float()).abs().max():.3g}")


def _last_equal(amp_trace, fp32_trace, i, name):
    """The fp32 value of ``name`` the last time (up to op ``i``) both runs held the same bits."""
    j = i
    while j >= 0 and name in fp32_trace[j]:
        if torch.equal(amp_trace[j][name], fp32_trace[j][name]):
            return fp32_trace[j][name]
        j -= 1
    if name.startswith("copy"):  # made at op j + 1: from the model's value then
        return _last_equal(amp_trace, fp32_trace, j + 1, "model." + name.split(".", 1)[1])
    return fp32_trace[j + 1][name]


def _close(got, want, start, tolerance):
    """O2's drift from fp32 within ``tolerance`` of the distance fp32 moved since the runs last agreed (+2e-3)."""
    travelled = (want.float() - start.float()).norm()
    return bool((got.float() - want.float()).norm() <= tolerance * travelled + 2e-3)


@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_random_programs_match_fp32(seed):
    run_program(seed)


def test_o2_matches_native_bf16_autocast_bitwise():
    """Same policy (linear and tanh in bf16, weights cast per forward, grads into the fp32 params): the same bits."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
        with torch.autocast("cpu", dtype=HALF):
            out = ref(x)
        F.mse_loss(out.float(), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with amp_patch.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("half,warns", [(torch.float16, True), (torch.bfloat16, False)])
def test_a_plain_backward_under_o2_trains(half, warns, caplog):
    """As native autocast without a scaler: the fp32 params train; float16 warns once (no loss scaling)."""
    model, _ = _models(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    before = model[0].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    ours = [r.getMessage() for r in caplog.records if "not produced inside amp_patch.scale_loss()" in r.getMessage()]
    assert len(ours) == (1 if warns else 0)
    assert all(m.startswith("SGD.step() under O2 with float16: ") for m in ours)
    assert not torch.equal(model[0].weight, before) and model[0].weight.dtype is torch.float32


def test_a_closure_optimizer_using_scale_loss_gets_no_unscaled_warning(caplog):
    """LBFGS runs its closure (with its scale_loss) inside step(): nothing was forgotten, nothing is said."""
    model, _ = _models(0)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0, loss_scale=128.0)
    x, y = torch.randn(5, 4), torch.randn(5, 3)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss

    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        for _ in range(3):
            opt.step(closure)
    assert [r for r in caplog.records if "scale_loss()" in r.getMessage()] == []


def test_o3_takes_an_optimizer_with_fp32_state():
    """Adam state made in fp32 (a loaded checkpoint, an earlier session) gets the half param's dtype; deinitialize
    gives the fp32 state back exactly where no step changed it."""
    model, _ = _models(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    amp_patch.initialize(model, opt, opt_level="O3", half_dtype=HALF, verbosity=0)
    assert all(s["exp_avg"].dtype is HALF for s in opt.state.values())
    amp_patch.deinitialize()
    for key, state in opt.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], saved["state"][key]["exp_avg"])
    amp_patch.initialize(model, opt, opt_level="O3", half_dtype=HALF, verbosity=0)
    opt.zero_grad()
    with amp_patch.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_segment_recomputes_on_compute_copies(reentrant):
    """The recompute runs during backward, after the model's call returned: the segment's own modules make
    their compute copies again, so the grads are bitwise those of the same O2 model without checkpointing."""
    class Net(torch.nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.ckpt = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), ckpt

        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=reentrant) if self.ckpt else self.a(x)
            return self.b(torch.tanh(h))

    grads = []
    for ckpt in (False, True):
        model = Net(ckpt)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp_patch.initialize(model, opt, opt_level="O2", half_dtype=HALF, verbosity=0)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=reentrant)
        with amp_patch.scale_loss(model(x).sum(), opt) as scaled:
            scaled.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert all(p.dtype is torch.float32 for p in model.parameters())
        amp_patch.deinitialize()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_submodule_called_on_its_own_runs_on_its_compute_copies():
    model, _ = _models(0)
    amp_patch.initialize(model, opt_level="O2", half_dtype=HALF, verbosity=0)
    h = model[0](torch.randn(2, 4).to(HALF))
    assert h.dtype is HALF and model[0].weight.dtype is torch.float32


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_inside_a_closure_is_not_stepped_on(level):
    """The step already runs when the closure's backward overflows: its grads become zeros (the step changes
    nothing), the step is reported skipped, the scale backs off, and the next step is not skipped for it."""
    model, _ = _models(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.float16, verbosity=0)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    before, scale = [p.detach().clone() for p in model.parameters()], amp_patch.loss_scale()

    def closure(factor):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y) * factor
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss

    opt.step(lambda: closure(float("inf")))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert amp_patch.last_step_skipped(opt) and amp_patch.loss_scale() == scale / 2
    opt.step(lambda: closure(1.0))
    assert not amp_patch.last_step_skipped(opt)
    assert not torch.equal(model[0].weight, before[0]) and all(torch.isfinite(p).all() for p in model.parameters())
