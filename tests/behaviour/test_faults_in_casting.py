"""Casting-side fault classes: a cast cache that cannot go stale or grow, out=, checkpoint
recompute, per-thread bookkeeping, wrappers as pass-throughs once their session ends."""
import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import amp_patch


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


@pytest.fixture
def o1():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    yield model, opt
    amp_patch.deinitialize()


def _native(model, x):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


# -- item 1: the cast cache never serves a weight changed through .data ------------------------------------------
def _assign(p, w):
    p.data = w.clone()


def _copy(p, w):
    p.data.copy_(w)


WRITES = {"data=": _assign, "data.copy_": _copy}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_data_writes_between_no_grad_evaluations_are_seen(o1, write):
    model, _ = o1
    x = torch.randn(3, 4)
    with torch.no_grad():
        model(x)  # caches the half weights (they require grad: grad mode need not be on to cache)
    new = [torch.randn_like(p) for p in model.parameters()]
    for p, w in zip(model.parameters(), new):
        WRITES[write](p, w)
    with torch.no_grad():
        got = model(x)
    amp_patch.deinitialize()
    try:
        assert torch.equal(got, _native(model, x)), "a weight changed through .data was served from the cache"
    finally:
        amp_patch.initialize(model, o1[1], opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)


def test_vector_to_parameters_between_evaluations_is_seen(o1):
    model, _ = o1
    x = torch.randn(3, 4)
    vec = torch.nn.utils.parameters_to_vector(model.parameters())
    with torch.no_grad():
        first = model(x)
        torch.nn.utils.vector_to_parameters(vec * 2, model.parameters())  # a model soup / line-search step
        second = model(x)
    assert not torch.equal(first, second)
    amp_patch.deinitialize()
    try:
        assert torch.equal(second, _native(model, x))
    finally:
        amp_patch.initialize(model, o1[1], opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)


def test_data_write_seen_by_a_functional_autocast_region(o1):
    """No module forward: an amp_patch.autocast() region inside the session drops the cache on exit, as
    torch.autocast drops its own when the outermost region exits."""
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    with torch.no_grad():
        with amp_patch.autocast():
            F.linear(x, w)
        w.data.copy_(torch.randn(4, 4))
        with amp_patch.autocast():
            got = F.linear(x, w)
    assert torch.equal(got, F.linear(x.bfloat16(), w.detach().bfloat16()))


# -- item 2: a loop that never calls scale_loss keeps the cache flat ---------------------------------------------
def test_adversarial_loop_without_scale_loss_keeps_the_cache_flat(o1):
    model, _ = o1
    engine = amp_patch.session.state.active_engine()
    x = torch.randn(3, 4)
    sizes = []
    for _ in range(6):  # an FGSM-style attack: a fresh leaf input that requires grad each iteration
        x = x.detach().requires_grad_()
        loss = model(x).float().sum()
        (grad,) = torch.autograd.grad(loss, x)
        x = x + 0.01 * grad.sign()
        sizes.append(len(engine.cache))
    assert len(set(sizes)) == 1 and sizes[0] <= 4, sizes


def test_functional_loop_without_modules_keeps_the_cache_flat(o1):
    engine = amp_patch.session.state.active_engine()
    w = torch.nn.Parameter(torch.randn(4, 4))
    sizes = []
    for _ in range(5):
        x = torch.randn(2, 4, requires_grad=True)  # an input leaf: never worth keeping past its call
        with amp_patch.autocast():
            F.linear(x, w).float().sum().backward()
            sizes.append(len(engine.cache))
    assert sizes == [1] * 5, sizes


# -- item 3: out= is honoured exactly as torch.autocast honours it (its out= overloads are not autocast ops) --------
def _out_cases():
    a, b, bb = torch.randn(3, 3), torch.randn(3, 3), torch.randn(2, 3, 3)
    return {
        "mm": (lambda o: torch.mm(a, b, out=o), (3, 3)),
        "matmul": (lambda o: torch.matmul(a, b, out=o), (3, 3)),
        "bmm": (lambda o: torch.bmm(bb, bb, out=o), (2, 3, 3)),
        "addmm": (lambda o: torch.addmm(a, a, b, out=o), (3, 3)),
        "add": (lambda o: torch.add(a, b.bfloat16(), out=o), (3, 3)),
        "exp": (lambda o: torch.exp(a.bfloat16(), out=o), (3, 3)),
        "sum": (lambda o: torch.sum(a, 0, keepdim=True, out=o), (1, 3)),
        "cat": (lambda o: torch.cat([a, b.bfloat16()], out=o), (6, 3)),
        "softmax": (lambda o: torch.log_softmax(a.bfloat16(), 0, out=o), (3, 3)),
    }


def _run_out(call, shape, out_dtype, native):
    out = torch.zeros(shape, dtype=out_dtype)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if native else amp_patch.autocast()
    try:
        with ctx:
            returned = call(out)
    except RuntimeError as exc:
        return "raised", type(exc), str(exc)
    return returned is out, out


@pytest.mark.parametrize("op_lists", ["apex", "torch_cpu"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32_out", "bf16_out"])
def test_out_arguments_match_native_autocast(op_lists, out_dtype):
    cases = _out_cases()
    theirs = {name: _run_out(call, shape, out_dtype, native=True) for name, (call, shape) in cases.items()}
    amp_patch.initialize(_net(), opt_level="O1", half_dtype=torch.bfloat16, op_lists=op_lists, verbosity=0)
    try:
        ours = {name: _run_out(call, shape, out_dtype, native=False) for name, (call, shape) in cases.items()}
    finally:
        amp_patch.deinitialize()
    for name in cases:
        assert ours[name][0] == theirs[name][0], (name, ours[name], theirs[name])  # written into out / raised
        if ours[name][0] == "raised":
            assert ours[name][1] is theirs[name][1], name
        else:
            assert ours[name][1].dtype is theirs[name][1].dtype, name
            assert torch.equal(ours[name][1], theirs[name][1]), (name, ours[name], theirs[name])


# -- item 4: checkpoint recomputes under the casting state its forward had ----------------------------------------
class Checkpointed(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
        self.head = torch.nn.Linear(4, 2)
        self.mode = mode

    def forward(self, x):
        if self.mode is None:
            h = self.inner(x)
        else:
            h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def _checkpoint_grads(mode, disabled_segment=False, disabled_backward=False):
    model = Checkpointed(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    try:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2)).requires_grad_()
        with amp_patch.autocast(enabled=not disabled_segment):
            out = model(x)
        with amp_patch.scale_loss(out.float().pow(2).sum(), opt) as scaled:
            with amp_patch.autocast(enabled=not disabled_backward):  # recompute must not see this
                scaled.backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("forward_off,backward_off", [(False, False), (True, False), (False, True)],
                         ids=["casting_on", "forward_in_autocast_off", "backward_in_autocast_off"])
def test_checkpoint_recomputes_under_the_forward_casting_state(mode, forward_off, backward_off):
    plain = _checkpoint_grads(None, forward_off, backward_off)
    checkpointed = _checkpoint_grads(mode, forward_off, backward_off)
    for a, b in zip(plain, checkpointed):
        assert a.dtype is b.dtype and torch.equal(a, b)


# -- item 7: wrappers outliving their session pass through; forked children never cast ------------------------------
def test_a_captured_wrapper_passes_through_after_deinitialize():
    amp_patch.initialize(_net(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    captured_mm, captured_linear = torch.mm, F.linear  # e.g. a library binding them at its import
    a, w = torch.randn(2, 4), torch.randn(3, 4)
    assert captured_mm(a, a.t()).dtype is torch.bfloat16
    amp_patch.deinitialize()
    assert captured_mm is not torch.mm
    assert captured_mm(a, a.t()).dtype is torch.float32 and torch.equal(captured_mm(a, a.t()), torch.mm(a, a.t()))
    assert torch.equal(captured_linear(a, w), F.linear(a, w))


def test_a_patch_on_top_of_ours_passes_through_after_deinitialize():
    amp_patch.initialize(_net(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    ours = torch.mm
    torch.mm = lambda *args, **kwargs: ours(*args, **kwargs)  # another library wraps the patched function
    try:
        amp_patch.deinitialize()  # (it leaves torch.mm as the other library set it, with a warning)
        a = torch.randn(2, 2)
        assert torch.mm(a, a).dtype is torch.float32
    finally:
        torch.mm = ours.__wrapped__


class _Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        a = torch.ones(2, 2)
        return str(torch.mm(a, a).dtype) + " " + str(F.linear(a, a).dtype)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs the fork start method")
def test_forked_dataloader_workers_never_cast():
    loader = torch.utils.data.DataLoader(_Probe(), batch_size=None, num_workers=1, multiprocessing_context="fork",
                                         persistent_workers=True)
    amp_patch.initialize(_net(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    try:
        during = list(loader)  # the persistent worker is forked here, inside the session
        main = torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
    finally:
        amp_patch.deinitialize()
    after = list(loader)  # the same worker process, after the parent's deinitialize
    del loader
    assert main is torch.bfloat16
    assert during == after == ["torch.float32 torch.float32"] * 2


# -- item 6: threads that share nothing do not see each other's scale_loss --------------------------------------------
def _train_copies(threaded, steps=3, n=4):
    base = _net()
    models = [copy.deepcopy(base) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    models, opts = amp_patch.initialize(models, opts, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    data = [(torch.randn(3, 4, generator=torch.Generator().manual_seed(k)), torch.randn(3, 2)) for k in range(n)]
    errors = []

    def train(k):
        try:
            for _ in range(steps):
                opts[k].zero_grad()
                loss = F.mse_loss(models[k](data[k][0]).float(), data[k][1])
                with amp_patch.scale_loss(loss, opts[k]) as scaled:
                    scaled.backward()
                opts[k].step()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    try:
        if threaded:
            barrier = threading.Barrier(n)
            threads = [threading.Thread(target=lambda k=k: (barrier.wait(30), train(k))) for k in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        else:
            for k in range(n):
                train(k)
    finally:
        amp_patch.deinitialize()
    assert not errors, errors
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def test_threads_training_their_own_copies_match_a_single_thread_bitwise():
    single = _train_copies(threaded=False)
    threaded = _train_copies(threaded=True)
    for a, b in zip(single, threaded):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_single_thread_foreign_grads_check_still_holds():
    models = [_net(), _net()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    models, opts = amp_patch.initialize(models, opts, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    try:
        x = torch.randn(3, 4)
        loss = (models[0](x).float() + models[1](x).float()).sum()
        with amp_patch.scale_loss(loss, opts[0]) as scaled:  # its backward also writes models[1]'s grads
            scaled.backward()
        with pytest.raises(amp_patch.UsageError, match="which did not name it"):
            opts[1].step()
    finally:
        amp_patch.deinitialize()


def test_a_backward_in_another_thread_inside_an_open_scale_loss_is_not_foreign():
    """The interleaving that made the threads' step() raise, forced: A's block is open while B's backward runs,
    and A exits before B does."""
    models = [_net(), _net()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    models, opts = amp_patch.initialize(models, opts, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    a_open, b_backward_done, a_closed = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def step(k, before_backward, after_backward, after_block):
        try:
            loss = models[k](torch.randn(3, 4)).float().sum()
            with amp_patch.scale_loss(loss, opts[k]) as scaled:
                before_backward()
                scaled.backward()
                after_backward()
            after_block()
            opts[k].step()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    a = threading.Thread(target=step, args=(0, lambda: (a_open.set(), b_backward_done.wait(30)), lambda: None,
                                            a_closed.set))
    b = threading.Thread(target=step, args=(1, a_open.wait, lambda: (b_backward_done.set(), a_closed.wait(30)),
                                            lambda: None))
    try:
        a.start()
        b.start()
        a.join(60)
        b.join(60)
    finally:
        amp_patch.deinitialize()
    assert not errors, errors


# -- item 5: op-list aliases ----------------------------------------------------------------------------------------
ALIAS_LISTS = {
    "conv2d_aliases": ("half:\n  torch: [conv2d]\nfloat:\n  torch.nn.functional: [conv2d]\n",
                       r":4: torch\.nn\.functional\.conv2d \(float\) and torch\.conv2d \(half, .*:2\) are one "
                       r"function"),
    "vf_two_names": ("half:\n  torch._VF: [lstm]\nfloat:\n  torch.nn.modules.rnn._VF: [lstm]\n",
                     r":4: .*are one attribute: torch\.nn\.modules\.rnn\._VF and torch\._VF are one module"),
    "vf_same_category": ("half:\n  torch._VF: [lstm]\n  torch.nn.modules.rnn._VF: [lstm]\n",
                         r":3: .*torch\.nn\.modules\.rnn\._VF and torch\._VF are one module"),
    "alias_added_later": ("extends: apex\nadd:\n  float:\n    torch.nn.functional: [conv2d]\n",
                          r":4: torch\.nn\.functional\.conv2d \(float\) and torch\.conv2d \(half, .*apex\.yaml"),
}


@pytest.mark.parametrize("case", sorted(ALIAS_LISTS))
def test_aliases_with_conflicting_entries_are_refused(tmp_path, case):
    text, pattern = ALIAS_LISTS[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    with pytest.raises(amp_patch.OpListError, match=pattern) as info:
        amp_patch.config.oplist.load_op_lists(str(path))
    assert str(info.value).startswith(str(path) + ":")


def test_an_alias_conflict_in_a_mapping_writes_the_other_entry_as_mapping_question_mark():
    """An inline mapping has no lines: the other entry is ``<mapping>:?`` as in the message's head, not ``:None``."""
    spec = {"half": {"torch": ["conv2d"]}, "float": {"torch.nn.functional": ["conv2d"]}}
    with pytest.raises(amp_patch.OpListError) as info:
        amp_patch.config.oplist.load_op_lists(spec)
    message = str(info.value)
    assert message.startswith("<mapping>:?: ") and "(half, <mapping>:?) are one function" in message, message
    assert "None" not in message, message


def test_aliases_with_one_category_load(tmp_path):
    path = tmp_path / "same.yaml"
    path.write_text("half:\n  torch: [conv2d]\n  torch.nn.functional: [conv2d]\n")
    assert len(amp_patch.config.oplist.load_op_lists(str(path))) == 2


class _WaitingSGD(torch.optim.SGD):
    def __init__(self, params, entered, release):
        super().__init__(params, lr=0.1)
        self.entered, self.release = entered, release

    def step(self, closure=None):
        self.entered.set()
        self.release.wait(30)
        return super().step(closure)


class _WaitingNet(torch.nn.Module):
    def __init__(self, entered, release):
        super().__init__()
        self.net, self.entered, self.release = _net(), entered, release

    def forward(self, x):
        h = self.net[0](x)
        self.entered.set()
        self.release.wait(30)
        return self.net[2](self.net[1](h))  # deinitialize here would mix half h with fp32 weights: raw errors


@pytest.mark.parametrize("where", ["forward", "scale_loss", "step"])
def test_deinitialize_refuses_while_another_thread_is_mid_step(where):
    entered, release = threading.Event(), threading.Event()
    model = _WaitingNet(entered, release) if where == "forward" else _net()
    opt = _WaitingSGD(model.parameters(), entered, release) if where == "step" else torch.optim.SGD(
        model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    errors = []

    def train():
        try:
            loss = model(torch.randn(3, 4)).float().sum()
            with amp_patch.scale_loss(loss, opt) as scaled:
                if where == "scale_loss":
                    entered.set()
                    release.wait(30)
                scaled.backward()
            opt.step()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=train, name="trainer")
    worker.start()
    try:
        assert entered.wait(30)
        with pytest.raises(amp_patch.UsageError, match="while thread 'trainer' is inside"):
            amp_patch.deinitialize()
    finally:
        release.set()
        worker.join(60)
        amp_patch.deinitialize()
    assert not errors, errors
    assert amp_patch.session.state.current() is None


def _region_grads(mode):
    model = Checkpointed(mode)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2)).requires_grad_()
    with amp_patch.autocast("cpu"):
        out = model(x)
    out.float().pow(2).sum().backward()  # outside the region, as with torch.autocast
    return out, [p.grad for p in model.parameters()] + [x.grad]


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpoint_backward_after_the_region_exits(mode):
    plain_out, plain = _region_grads(None)
    out, checkpointed = _region_grads(mode)
    assert out.dtype is plain_out.dtype is torch.bfloat16
    for a, b in zip(plain, checkpointed):
        assert a.dtype is b.dtype and torch.equal(a, b)
    assert amp_patch.session.state.active_engine() is None
