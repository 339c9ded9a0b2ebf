"""Native ``torch.autocast(enabled=False)`` regions run in fp32 under an O1 session, as under native autocast:
RoPE-shaped code, nested enabled regions, regions of another device type, threads and
amp_patch's own regions. Oracle: native ``torch.autocast("cpu", bfloat16)``, bitwise, with the torch_cpu list."""
import threading
import warnings

import pytest
import torch

import amp_patch

BF16 = torch.bfloat16


class Rotary(torch.nn.Module):
    """Llama-style rotary embedding: ``inv_freq @ positions`` in an fp32 region, as transformers writes it."""

    def __init__(self, region):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.region = region

    def forward(self, x):
        x = self.lin(x)
        pos = torch.arange(x.shape[0], dtype=torch.float32)[None, :] * 37.0
        with self.region():
            freqs = (self.inv_freq[:, None].float() @ pos).t()
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos()
        return x * cos.to(x.dtype)


class Region(torch.nn.Module):
    """``lin0``, then ``mm`` inside ``region`` (the issue's minimal program), optionally with an inner region."""

    def __init__(self, region, inner=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin0 = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.region, self.inner = region, inner

    def forward(self, x):
        x = self.lin0(x)
        with self.region():
            x = torch.mm(x.float(), self.w)
            if self.inner is not None:
                with self.inner():
                    x = torch.mm(x, self.w)
        return x.sum()


def _off():
    return torch.autocast("cpu", enabled=False)


def _on():
    return torch.autocast("cpu", dtype=BF16)


def _run(model, x):
    out = model(x)
    out.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.detach(), grads


def _native(model, x):
    with torch.autocast("cpu", dtype=BF16):
        out = model(x)
    out.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.detach(), grads


def _amp(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, _ = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=BF16, op_lists="torch_cpu",
                                    verbosity=0)
    try:
        return _run(model, x)
    finally:
        amp_patch.deinitialize()


def _assert_bitwise(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert out_a.dtype == out_b.dtype and torch.equal(out_a, out_b), (out_a, out_b)
    for ga, gb in zip(grads_a, grads_b):
        assert ga.dtype == gb.dtype and torch.equal(ga, gb)


def test_rope_region_matches_native_bitwise():
    torch.manual_seed(0)
    model, x = Rotary(_off), torch.randn(64, 8)
    native = _native(model, x)
    _assert_bitwise(_amp(model, x), native)
    with torch.autocast("cpu", dtype=BF16), torch.no_grad():  # the region matters here: bf16 cos is far off
        sloppy = Rotary(_on)  # the same code without its fp32 region
        sloppy.load_state_dict(model.state_dict())
        assert not torch.equal(sloppy(x), native[0])


@pytest.mark.parametrize("region", [_off, lambda: torch.cpu.amp.autocast(enabled=False)], ids=["autocast", "cpu_amp"])
def test_minimal_program_matches_native_bitwise(region):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cpu.amp.autocast is deprecated
        model, x = Region(region), torch.randn(3, 4)
        native = _native(model, x)
        result = _amp(model, x)
    assert native[0].dtype == torch.float32
    _assert_bitwise(result, native)


def test_nested_enabled_region_casts_again():
    model, x = Region(_off, inner=_on), torch.randn(3, 4)
    _assert_bitwise(_amp(model, x), _native(model, x))


def test_region_of_another_device_type_changes_nothing():
    """A ``torch.autocast("cuda", enabled=False)`` region on a CPU run leaves CPU autocast on, natively too."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "CUDA is not available. Disabling"
        model, x = Region(lambda: torch.autocast("cuda", enabled=False)), torch.randn(3, 4)
        native = _native(model, x)
        result = _amp(model, x)
    assert native[0].dtype == BF16
    _assert_bitwise(result, native)


@pytest.fixture
def session():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, opt_level="O1", half_dtype=BF16, op_lists="torch_cpu", verbosity=0)
    yield
    amp_patch.deinitialize()


def _mm_dtype():
    return torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype


def test_amp_patch_regions_are_counted_apart(session):
    """A native enabled region undoes native disabled ones only, not disable_casts()/autocast(enabled=False);
    an amp_patch.autocast() region (a no-op in a session) does not undo a native disabled one."""
    with amp_patch.disable_casts():
        with _on():
            assert torch.is_autocast_enabled("cpu")  # native casts here; amp_patch stays off
        with _off():
            assert _mm_dtype() == torch.float32
        assert _mm_dtype() == torch.float32
    with _off():
        with amp_patch.autocast():
            assert _mm_dtype() == torch.float32
        with amp_patch.autocast(enabled=False):
            assert _mm_dtype() == torch.float32
        assert _mm_dtype() == torch.float32
    assert _mm_dtype() == BF16


def test_region_closed_by_an_exception_restores_casting(session):
    with pytest.raises(ZeroDivisionError), _off():
        1 / 0  # noqa: B018 - the division is what raises
    assert _mm_dtype() == BF16


def test_region_in_one_thread_leaves_another_casting(session):
    seen, inside, release = [], threading.Event(), threading.Event()

    def other():
        inside.wait()
        seen.append(_mm_dtype())
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    with _off():
        inside.set()
        release.wait(60)
        seen.append(_mm_dtype())
    thread.join()
    assert seen == [BF16, torch.float32]


class _Scale(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return torch.mm(grad, w.t()), torch.mm(x.t(), grad)


def test_custom_bwd_region_keeps_the_forward_casting():
    """custom_bwd opens a region with the forward's native state (off under amp_patch): left alone, so the
    backward casts as the forward did, as natively."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return _Scale.apply(x, self.w)

    model, x = Net(), torch.randn(3, 4, requires_grad=True)
    _assert_bitwise(_amp(model, x), _native(model, x))


class _Fp32Mm(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return torch.mm(grad, w.t()), torch.mm(x.t(), grad)


@pytest.mark.parametrize("function", [_Fp32Mm, _Scale], ids=["cast_inputs_fp32", "cast_inputs_none"])
def test_custom_fwd_matches_native_bitwise(function):
    """custom_fwd(cast_inputs=torch.float32): the forward (on inputs cast to fp32) and its custom_bwd backward run
    in fp32; without cast_inputs both cast, as natively."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 4)
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return function.apply(self.lin(x), self.w)

    model, x = Net(), torch.randn(3, 4)
    native = _native(model, x)
    assert native[0].dtype == (torch.float32 if function is _Fp32Mm else BF16)
    _assert_bitwise(_amp(model, x), native)


def test_is_autocast_enabled_answers_as_torch_outside_custom_fwd(session):
    assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled()
    with _on():
        assert torch.is_autocast_enabled("cpu")


class _Record(torch.autograd.Function):
    seen = []

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        _Record.seen.append((torch.is_autocast_enabled("cpu"), _mm_dtype()))
        return grad


def test_custom_bwd_replays_amp_patch_casting_not_native(session):
    """The forward saw amp_patch's casting: its backward casts with amp_patch, native autocast stays off there
    (no second cast on top of amp_patch's)."""
    _Record.seen.clear()
    _Record.apply(torch.ones(2, requires_grad=True)).sum().backward()
    with amp_patch.disable_casts():
        _Record.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert _Record.seen == [(False, BF16), (False, torch.float32)]


def test_compiled_region_matches_eager_without_graph_breaks():
    """dynamo enters native regions itself, at trace time: the compiled region runs in fp32 too, no break."""
    import torch._dynamo

    model, x = Region(_off), torch.randn(3, 4)
    native = _native(model, x)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, _ = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=BF16, op_lists="torch_cpu", verbosity=0)
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(model.forward)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="eager")(x)
        assert compiled.dtype == native[0].dtype and torch.equal(compiled, native[0])
    finally:
        torch._dynamo.reset()
        amp_patch.deinitialize()


def test_transformers_llama_rotary_matches_native_bitwise(session):
    """transformers' own LlamaRotaryEmbedding (its fp32 region), positions up to 2047: before the fix its cos was
    up to 2.0 off native autocast in bf16."""
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    rope = modeling.LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4))
    x, positions = torch.zeros(1, 2048, 64), torch.arange(2048)[None]
    cos, sin = rope(x, positions)
    amp_patch.deinitialize()
    with torch.autocast("cpu", dtype=BF16):
        native_cos, native_sin = rope(x, positions)
    assert torch.equal(cos, native_cos) and torch.equal(sin, native_sin)
