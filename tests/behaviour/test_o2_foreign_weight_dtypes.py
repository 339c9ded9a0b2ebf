"""O2/O3 models whose weights come in another dtype at a forward. O2: the fp32 params are the weights, so
``torch.func.functional_call`` with the fp32 ``state_dict()`` runs exactly as the model itself (half compute
copies of the tensors passed). O3: functional_call with fp32 weights runs in fp32 (inputs follow the weights
actually used), and a cast param given an fp32 value (``param.data = ...``) is refused at the next forward,
naming the fix."""
import copy

import pytest
import torch

import amp_patch


def _models(level="O2"):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    return ref, model


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_functional_call_with_the_fp32_state_dict_matches_fp32_bitwise(level):
    ref, model = _models(level)
    x = torch.randn(5, 4)
    got = torch.func.functional_call(model, model.state_dict(), (x,))
    assert got.dtype is torch.float32
    if level == "O2":  # the state_dict is the model's own fp32 weights: the same half compute as model(x)
        assert torch.equal(got, model(x)) and next(model.parameters()).dtype is torch.float32
        return
    want = ref.state_dict()  # O2: the fp32 masters; O3 (no masters): fp32 copies of the bf16 weights
    want = want if level == "O2" else {k: v.bfloat16().float() for k, v in want.items()}
    assert torch.equal(got, torch.func.functional_call(ref, want, (x,)))
    assert model(x).dtype is torch.float32 and next(model.parameters()).dtype is torch.bfloat16


def test_torch_func_grad_through_functional_call_matches_the_models_own_grads_bitwise():
    """O2: grads of the fp32 weights through their half compute copies, as autograd gives the model's params."""
    _, model = _models()
    x = torch.randn(5, 4)
    got = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(dict(model.state_dict()))
    model(x).sum().backward()
    want = dict(model.named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].grad) for k in want)
    assert all(g.dtype is torch.float32 for g in got.values())


def test_functional_call_with_half_weights_runs_in_half():
    _, model = _models()
    half = {k: v.bfloat16() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)
    assert torch.equal(torch.func.functional_call(model, half, (x,)), model(x))


@pytest.mark.parametrize("how", ["data", "functional_call"])
def test_a_param_given_another_dtype_is_refused_at_the_forward(how):
    _, model = _models("O3")  # (O2: an fp32 value is what every param holds; see test_o2_weight_ownership.py)
    x = torch.randn(5, 4)
    with pytest.raises(amp_patch.UsageError, match=r"'2\.bias' .* torch\.float32 .* torch\.bfloat16.*\.to\("):
        if how == "data":
            model[2].bias.data = torch.full((2,), 0.5)
            model(x)
        else:
            torch.func.functional_call(model, {"2.bias": torch.zeros(2)}, (x,))
    model[2].bias.data = torch.full((2,), 0.5).bfloat16()  # the fix the message names
    assert model(x).dtype is torch.float32


@pytest.mark.parametrize("how", ["item", "attribute", "register", "data"])
def test_o2_a_param_assigned_another_dtype_inside_the_call_is_refused_at_the_input_cast(how):
    """A forward pre-hook replacing a param's copy with another dtype (before the input cast runs) is refused at
    the input cast, naming the fix."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))

    def assign(module, args):
        if how == "item":
            module[2]._parameters["bias"] = torch.zeros(2)
        elif how == "attribute":
            module[2].bias = torch.nn.Parameter(torch.zeros(2))
        elif how == "register":
            module[2].register_parameter("bias", torch.nn.Parameter(torch.zeros(2)))
        else:  # (through .data: no version counter, no assignment to see)
            module[2].bias.data = torch.zeros(2)

    hook = model.register_forward_pre_hook(assign)  # (before initialize: it runs before amp_patch's input cast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(amp_patch.UsageError, match=r"'2\.bias' .* torch\.float32 .* torch\.bfloat16"):
        model(torch.randn(5, 4))
    hook.remove()
    assert model(torch.randn(5, 4)).dtype is torch.float32



@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_o2_a_weight_given_a_half_value_is_refused_and_half_tensors_of_ones_own_still_run(half):
    """Under O2 the fp32 params are the weights the optimizer steps (no other copy): one whose ``.data`` was given a
    half dtype would train in half, silently. It is refused at the next forward, naming the fix; half tensors
    passed through functional_call (not the model's params) run, and fp64 (no precision lost) runs."""
    _, model = _models("O2")
    x = torch.randn(5, 4)
    state = {k: v.to(half) for k, v in model.state_dict().items()}
    assert torch.func.functional_call(model, state, (x,)).dtype is torch.float32
    model[2].weight.data = model[2].weight.data.to(torch.float64)
    model(x)
    model[2].weight.data = model[2].weight.data.to(half)
    with pytest.raises(amp_patch.UsageError, match=rf"'2\.weight' .* {half} .*model\.2\.weight\.data = value\.to"):
        model(x)
    model[2].weight.data = model[2].weight.data.float()
    assert model(x).dtype is torch.float32


def test_o2_keeps_fp32_masters_for_a_model_that_comes_in_half():
    """allow_incoming_model_not_fp32 with a bf16 model: its params cannot be O2's fp32 weights, so O2 keeps fp32
    masters beside them (as the apex alias does); updates too small for bf16 still move the masters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0,
                                      allow_incoming_model_not_fp32=True)
    masters = list(amp_patch.master_params(opt))
    assert [p.dtype for p in masters] == [torch.float32] * 4
    before = [p.detach().clone() for p in masters]
    with amp_patch.scale_loss(model(torch.randn(3, 4)).float().sum() * 1e-2, opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, amp_patch.master_params(opt)))
