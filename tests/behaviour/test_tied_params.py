"""Tied and shared parameters (GPT-2's wte/lm_head) wherever amp_patch maps parameters: state_dict,
load_state_dict, masters, master_params, overflow diagnostics; and a bit-exact resume of a tied model."""
import io

import pytest
import torch
import torch.nn.functional as F
from tests_support import compute_dtypes

import amp_patch


class TiedLM(torch.nn.Module):
    """embedding -> linear -> batchnorm -> head whose weight IS the embedding's (as GPT-2 ties wte and lm_head)."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.fc = torch.nn.Linear(dim, dim)
        self.bn = torch.nn.BatchNorm1d(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(self.bn(torch.tanh(self.fc(self.wte(ids)))))


def _setup(level, seed=0):
    torch.manual_seed(seed)
    model = TiedLM()
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if level != "O3"  # (fp16 Adam state: NaN under O3)
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return amp_patch.initialize(model, opt, opt_level=level, verbosity=0)


def _train(model, opt, steps, seed):
    _continue(model, opt, steps, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_state_dict_is_fp32_under_every_name(level):
    model, opt = _setup(level)
    _train(model, opt, 2, seed=1)
    state = model.state_dict()
    assert {k for k, v in state.items() if v.is_floating_point() and v.dtype is not torch.float32} == set()
    # the forward runs half (O2: a compute copy, cast once for both names; O3: the half model itself)
    assert compute_dtypes(model, torch.randint(0, 11, (6,)))["lm_head.weight"] is torch.float16
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])
    if level == "O2":  # the fp32 params are the masters, not an upcast of half values
        master = next(m for m in amp_patch.master_params(opt) if m.shape == model.wte.weight.shape)
        assert master is model.wte.weight and model.lm_head.weight is master
        assert torch.equal(state["lm_head.weight"], master) and not torch.equal(master.half().float(), master)
    else:
        assert torch.equal(state["lm_head.weight"], model.wte.weight.float())
        assert state["bn.running_mean"].dtype is torch.float32  # O3 casts batchnorm too; Apex reported fp32


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_load_state_dict_keeps_ties_and_writes_masters(level):
    model, opt = _setup(level)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["wte.weight"] = new["lm_head.weight"] = torch.full_like(new["wte.weight"], 0.3)
    model.load_state_dict(new)
    assert model.lm_head.weight is model.wte.weight
    assert model.wte.weight.dtype is (torch.float32 if level == "O2" else torch.float16)  # (O2: the master)
    assert torch.equal(model.lm_head.weight, torch.full_like(model.lm_head.weight, 0.3))
    expected = new["wte.weight"] if level == "O2" else new["wte.weight"].half().float()  # O2: the masters too
    assert torch.equal(model.state_dict()["lm_head.weight"], expected)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_master_params_hold_a_tied_param_once(level):
    model, opt = _setup(level)
    unique = list(model.parameters())
    masters = list(amp_patch.master_params(opt))
    assert len(masters) == len(unique) == 5  # wte/lm_head, fc.weight, fc.bias, bn.weight, bn.bias
    assert all(m.dtype is (torch.float32 if level == "O2" else p.dtype) for m, p in zip(masters, unique))
    amp_patch.deinitialize()
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.dtype is torch.float32


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_resume_of_a_tied_model_is_bit_exact(level):
    model, opt = _setup(level)
    _train(model, opt, 5, seed=3)
    straight = {k: v.clone() for k, v in model.state_dict().items()}
    amp_patch.deinitialize()

    model, opt = _setup(level)
    _train(model, opt, 3, seed=3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp_patch.state_dict()}, buf)
    amp_patch.deinitialize()
    buf.seek(0)
    ckpt = torch.load(buf)
    model, opt = _setup(level, seed=99)  # different initial weights: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    amp_patch.load_state_dict(ckpt["amp"])
    assert model.lm_head.weight is model.wte.weight
    g = torch.Generator().manual_seed(3)  # the data stream after 3 steps of the straight run
    for _ in range(3):
        torch.randint(0, 11, (6,), generator=g), torch.randint(0, 11, (6,), generator=g)
    _continue(model, opt, 2, g)
    resumed = model.state_dict()
    assert straight.keys() == resumed.keys() and all(torch.isfinite(v).all() for v in resumed.values())
    for key in straight:
        assert straight[key].dtype is resumed[key].dtype and torch.equal(straight[key], resumed[key]), key


def _continue(model, opt, steps, g):
    for _ in range(steps):
        ids = torch.randint(0, 11, (6,), generator=g)
        loss = F.cross_entropy(model(ids).float(), torch.randint(0, 11, (6,), generator=g))
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()


def test_overflow_diagnostics_name_a_tied_param_once_with_its_other_names():
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", verbosity=0, diagnose_overflow=True)
    out = model(torch.tensor([1, 2, 3]))
    with amp_patch.scale_loss(out.float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    rows = {row["param"]: row for row in amp_patch.last_overflow()["params"]}
    assert rows["wte.weight"]["tied"] == ["lm_head.weight"] and "lm_head.weight" not in rows
