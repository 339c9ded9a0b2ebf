"""Module-scoped op lists (the scopes: section): dtypes per scope, nesting, threads, compile, trace, errors."""
import logging
import os
import sys
import threading

import pytest
import torch
from tests_support import run_python
from torch import nn

import amp_patch
from amp_patch.config.scopes import compile_glob
from amp_patch.tools import cli

HALF = torch.float16


class Bmm(nn.Module):
    def forward(self, x):
        return torch.bmm(x, x.transpose(1, 2))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Bmm()
        self.inner = Bmm()

    def forward(self, x):
        return {"attn": self.attn(x).dtype, "block_bmm": torch.bmm(x, x.transpose(1, 2)).dtype,
                "block_mm": torch.mm(x[0], x[0].t()).dtype}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.other = Bmm()

    def forward(self, x):
        return [layer(x) for layer in self.layers], self.other(x).dtype, torch.bmm(x, x.transpose(1, 2)).dtype


def _init(model, scopes, **kw):
    return amp_patch.initialize(model, opt_level="O1", half_dtype=HALF, verbosity=0,
                                op_lists={"extends": "apex", "scopes": scopes}, **kw)


X = torch.randn(2, 3, 4)


def test_scope_applies_inside_matching_modules_only():
    model = _init(Net(), {"layers.*.attn": {"float": {"torch": ["bmm"]}}})
    try:
        layers, other, top = model(X)
    finally:
        amp_patch.deinitialize()
    assert [layer["attn"] for layer in layers] == [torch.float32, torch.float32]
    assert [layer["block_bmm"] for layer in layers] == [HALF, HALF]  # the enclosing block is not scoped
    assert (other, top) == (HALF, HALF)


def test_innermost_scope_decides_per_op_and_unlisted_ops_fall_through():
    scopes = {"layers.0": {"float": {"torch": ["bmm", "mm"]}}, "layers.0.attn": {"half": {"torch": ["bmm"]}}}
    model = _init(Net(), scopes)
    try:
        (first, second), _, top = model(X)
    finally:
        amp_patch.deinitialize()
    assert first == {"attn": HALF, "block_bmm": torch.float32, "block_mm": torch.float32}
    assert second == {"attn": HALF, "block_bmm": HALF, "block_mm": HALF}
    assert top == HALF


def test_an_op_only_scopes_name_keeps_its_dtype_outside_them():
    # tanh is in no category of the apex list: outside the scope it runs in its input's dtype
    class Tanh(nn.Module):
        def forward(self, x):
            return torch.tanh(x).dtype

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Tanh(), Tanh()

        def forward(self, x):
            return self.a(x), self.b(x), torch.tanh(x).dtype

    model = _init(Two(), {"a": {"half": {"torch": ["tanh"]}}})
    try:
        assert model(torch.randn(3)) == (HALF, torch.float32, torch.float32)
    finally:
        amp_patch.deinitialize()


def test_glob_star_is_one_path_part_and_double_star_any():
    assert compile_glob("layers.*.attn").fullmatch("layers.0.attn")
    assert not compile_glob("layers.*.attn").fullmatch("layers.0.x.attn")
    assert compile_glob("**.attn").fullmatch("layers.0.x.attn")
    assert compile_glob("layers.**").fullmatch("layers.0.x")
    assert not compile_glob("attn").fullmatch("layers.0.attn")


def test_reentrant_and_an_exception_inside_a_scope_leaves_no_scope_open():
    class Recursive(nn.Module):
        def forward(self, x, depth):
            if depth == 0:
                raise RuntimeError("boom")
            assert torch.bmm(x, x.transpose(1, 2)).dtype == torch.float32
            return self(x, depth - 1)

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.rec = Recursive()

    holder = _init(Holder(), {"rec": {"float": {"torch": ["bmm"]}}})
    engine = amp_patch.session.state.active_engine()
    try:
        with pytest.raises(RuntimeError, match="boom"):
            holder.rec(X, 3)
        assert engine.scopes.active == {}
        assert torch.bmm(X, X.transpose(1, 2)).dtype == HALF
    finally:
        amp_patch.deinitialize()
    assert "forward" not in vars(holder.rec)  # the scope's routing is undone


def test_a_scope_open_in_one_thread_does_not_leak_into_another():
    inside, done = threading.Event(), threading.Event()
    seen = {}

    class Waits(nn.Module):
        def forward(self, x):
            inside.set()
            done.wait(10)
            return torch.bmm(x, x.transpose(1, 2)).dtype

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = Waits()

    holder = _init(Holder(), {"w": {"float": {"torch": ["bmm"]}}})
    try:
        worker = threading.Thread(target=lambda: seen.setdefault("scoped", holder.w(X)))
        worker.start()
        assert inside.wait(10)
        seen["other thread"] = torch.bmm(X, X.transpose(1, 2)).dtype  # while the worker is inside its scope
        done.set()
        worker.join(10)
    finally:
        amp_patch.deinitialize()
    assert seen == {"scoped": torch.float32, "other thread": HALF}


def test_compiled_model_keeps_the_scope_dtypes():
    torch._dynamo.reset()
    model = _init(Net(), {"layers.*.attn": {"float": {"torch": ["bmm"]}}})
    try:
        eager = model(X)
        compiled = torch.compile(model, backend="eager")(X)
    finally:
        amp_patch.deinitialize()
        torch._dynamo.reset()
    assert compiled == eager
    assert eager[0][0]["attn"] == torch.float32


_EXPLAIN = """
import sys, torch, amp_patch, test_scoped_op_lists as t
for scopes in ({}, {"layers.*.attn": {"float": {"torch": ["bmm"]}}}):
    model = t._init(t.Net(), scopes)
    try:
        e = torch._dynamo.explain(model)(t.X)
    finally:
        amp_patch.deinitialize()
        torch._dynamo.reset()
    print("breaks", e.graph_break_count, "graphs", e.graph_count, flush=True)
"""


def test_compile_breaks_the_graph_once_per_scoped_call_and_nowhere_else(tmp_path):
    """docs/op_lists.md: a scoped module runs eagerly, one graph break per call; the rest compiles. Measured in a
    fresh interpreter, away from what earlier tests left in dynamo (tests/behaviour/test_compile_keeps_casts.py
    covers the process group that once made every later session break the graph)."""
    assert run_python(_EXPLAIN, tmp_path)[:2] == ["breaks 0 graphs 1", "breaks 2 graphs 3"]


def test_trace_names_the_scope_that_decided_each_call():
    model = _init(Net(), {"layers.0.attn": {"float": {"torch": ["bmm"]}}})
    try:
        with amp_patch.trace() as t:
            model(X)
    finally:
        amp_patch.deinitialize()
    rows = {(r["module"], r["qualname"]): r for r in t.report()}
    assert rows[("layers.0.attn", "torch.bmm")]["scope"] == "layers.0.attn"
    assert rows[("layers.0.attn", "torch.bmm")]["category"] == "float"
    assert rows[("layers.1.attn", "torch.bmm")]["scope"] == "(global)"
    assert rows[("layers.1.attn", "torch.bmm")]["source"].startswith("op_lists/apex.yaml:")
    assert "| scope |" in t.to_markdown()


def test_scopes_in_yaml_extend_the_base_and_errors_name_the_line(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text('extends: apex\nscopes:\n  "a":\n    float:\n      torch: [bmm]\n')
    child = tmp_path / "child.yaml"
    child.write_text('extends: base.yaml\nscopes:\n  "b.*":\n    promote:\n      torch: [mm]\n')
    table = amp_patch.load_op_lists(str(child))
    assert {(s.glob, s.path, s.line) for s in table.scopes} == {("a", str(base), 3), ("b.*", str(child), 3)}
    bad = tmp_path / "bad.yaml"
    bad.write_text('extends: apex\nscopes:\n  "a":\n    banned:\n      torch: [bmm]\n')
    with pytest.raises(amp_patch.OpListError, match=r"bad.yaml:4: .*category 'banned' is not allowed"):
        amp_patch.load_op_lists(str(bad))
    bad.write_text('extends: apex\nscopes:\n  "a..b":\n    float:\n      torch: [bmm]\n')
    with pytest.raises(amp_patch.OpListError, match=r"bad.yaml:3: .*not a module path glob"):
        amp_patch.load_op_lists(str(bad))
    bad.write_text('extends: apex\nscopes:\n  "a":\n    float:\n      torch: [no_such_op]\n')
    with pytest.raises(amp_patch.OpListError, match=r"bad.yaml:5: .*no_such_op"):
        amp_patch.load_op_lists(str(bad))


def test_a_glob_matching_no_module_warns_at_initialize_and_fails_validate_job(tmp_path, caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        _init(Net(), {"layers.*.atn": {"float": {"torch": ["bmm"]}}})
        amp_patch.deinitialize()
    assert "'layers.*.atn'" in caplog.text and "matches no module" in caplog.text
    jobs = tmp_path / "scope_jobs.py"
    jobs.write_text("import torch\nfrom test_scoped_op_lists import Net\n\ndef job():\n    return {'model_fn': Net, "
                    "'optimizer_fn': torch.optim.SGD, 'data_fn': torch.randn, 'loss_fn': torch.add}\n")
    good, typo = tmp_path / "good.yaml", tmp_path / "typo.yaml"
    good.write_text('extends: apex\nscopes:\n  "layers.*.attn":\n    float:\n      torch: [bmm]\n')
    typo.write_text('extends: apex\nscopes:\n  "layers.*.atn":\n    float:\n      torch: [bmm]\n')
    sys.path.insert(0, str(tmp_path))
    try:
        assert cli.main(["validate", str(good), "--job", "scope_jobs:job"]) == 0
        assert cli.main(["validate", str(typo), "--job", "scope_jobs:job"]) == 1
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("scope_jobs", None)
    captured = capsys.readouterr()
    assert f"{good}: OK, " in captured.out and "; 1 scope(s): layers.*.attn" in captured.out
    err = captured.err
    assert f"{typo}:3: scope 'layers.*.atn' matches no module" in err
    assert os.fspath(good) not in err


def test_scopes_in_an_autocast_region_warn_that_they_do_nothing():
    spec = {"extends": "apex", "scopes": {"a": {"float": {"torch": ["bmm"]}}}}
    with pytest.warns(UserWarning, match="scopes: section has no effect in an autocast"):
        with amp_patch.autocast(half_dtype=HALF, op_lists=spec):
            assert torch.bmm(X, X.transpose(1, 2)).dtype == HALF


def test_a_deepcopy_of_a_scoped_model_runs_its_own_weights_in_the_scope():
    import copy

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    model = _init(Lin(), {"fc": {"float": {"torch.nn.functional": ["linear"]}}})
    try:
        ema = copy.deepcopy(model)
        with torch.no_grad():
            ema.fc.weight.zero_()
            ema.fc.bias.zero_()
        x = torch.randn(2, 4)
        out, ema_out = model(x), ema(x)
    finally:
        amp_patch.deinitialize()
    assert out.dtype == ema_out.dtype == torch.float32
    assert bool((ema_out == 0).all()) and not bool((out == 0).all())
