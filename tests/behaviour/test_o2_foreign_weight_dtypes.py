"""O2/O3 models whose weights come in another dtype at a forward: ``torch.func.functional_call`` with the fp32
``state_dict()`` runs in fp32 (inputs follow the weights actually used), and a cast param given an fp32 value
(``param.data = ...``) is refused at the next forward, naming the fix."""
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
    want = ref.state_dict()  # O2: the fp32 masters; O3 (no masters): fp32 copies of the bf16 weights
    want = want if level == "O2" else {k: v.bfloat16().float() for k, v in want.items()}
    assert torch.equal(got, torch.func.functional_call(ref, want, (x,)))
    assert model(x).dtype is torch.float32 and next(model.parameters()).dtype is torch.bfloat16


def test_torch_func_grad_through_functional_call_matches_fp32_bitwise():
    ref, model = _models()
    x = torch.randn(5, 4)

    def grads(m):
        return torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).sum())(dict(m.state_dict()))

    got, want = grads(model), grads(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_functional_call_with_half_weights_runs_in_half():
    _, model = _models()
    half = {k: v.bfloat16() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4)
    assert torch.equal(torch.func.functional_call(model, half, (x,)), model(x))


@pytest.mark.parametrize("how", ["data", "functional_call"])
def test_a_param_given_another_dtype_is_refused_at_the_forward(how):
    _, model = _models()
    x = torch.randn(5, 4)
    with pytest.raises(amp_patch.UsageError, match=r"'2\.bias' .* torch\.float32 .* torch\.bfloat16.*\.to\("):
        if how == "data":
            model[2].bias.data = torch.full((2,), 0.5)
            model(x)
        else:
            torch.func.functional_call(model, {"2.bias": torch.zeros(2)}, (x,))
    model[2].bias.data = torch.full((2,), 0.5).bfloat16()  # the fix the message names
    assert model(x).dtype is torch.float32
