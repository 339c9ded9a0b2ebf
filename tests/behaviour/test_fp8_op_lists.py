"""The ``fp8`` op-list category: loading (recipe, alias moves, scopes, errors at their line), the wrapper under O1
(half output, weight quantized once per forward, half fallback for shapes the scaled matmul cannot take, exact
undo), torch.compile, the trace, validate and the doctor. Numerics against torchao: tests/oracle."""
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch
from amp_patch.casting import fp8 as fp8_module
from amp_patch.config.oplist import load_op_lists
from amp_patch.patching import registry
from amp_patch.tools import cli

LINEAR_IN_FP8 = {"fp8": {"torch.nn.functional": ["linear"]}}


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return str(path)


# ------------------------------------------------------------------------------------------------ loading

def test_adding_linear_to_fp8_moves_its_alias_out_of_half_too():
    table = load_op_lists({"extends": "torch_cpu", "add": LINEAR_IN_FP8})
    assert table.category_of("torch.nn.functional", "linear") == "fp8"
    assert table.category_of("torch._C._nn", "linear") == "fp8"  # one function: it moves along
    assert table.category_of("torch", "matmul") == "half"
    assert table.fp8_recipe == "tensorwise"
    # the reverse move (out of fp8) takes the alias along as well
    back = load_op_lists(["fp8_linear_cpu", {"add": {"half": {"torch.nn.functional": ["linear"]}}}])
    assert back.category_of("torch._C._nn", "linear") == "half"


def test_an_alias_conflict_outside_fp8_is_still_refused():
    with pytest.raises(amp_patch.OpListError, match="are one function"):
        load_op_lists({"extends": "torch_cpu", "add": {"float": {"torch.nn.functional": ["linear"]}}})


def test_the_recipe_is_inherited_through_extends_and_overridden_by_a_later_layer(tmp_path):
    _write(tmp_path, "base.yaml", """
        extends: torch_cpu
        fp8_recipe: rowwise
        add: {fp8: {torch.nn.functional: [linear]}}
        """)
    child = _write(tmp_path, "child.yaml", "extends: base.yaml\nadd: {fp8: {torch: [mm]}}\n")
    assert load_op_lists(child).fp8_recipe == "rowwise"
    assert load_op_lists([child, {"fp8_recipe": "tensorwise"}]).fp8_recipe == "tensorwise"
    assert load_op_lists("fp8_linear_cuda_rowwise").fp8_recipe == "rowwise"
    assert load_op_lists({"fp8": {"torch": ["mm"]}}).fp8_recipe == "tensorwise"  # a full list: the default


@pytest.mark.parametrize("text, line, fragment", [
    ("extends: torch_cpu\nfp8_recipe: blockwise\n", 2, "fp8_recipe 'blockwise' is not a recipe; allowed: "
                                                       "tensorwise, rowwise"),
    ("extends: torch_cpu\nadd:\n  fp8:\n    torch:\n      - conv2d\n", 5, "torch.conv2d cannot be fp8"),
    ("scopes:\n  enc:\n    fp8:\n      torch.nn.functional: [gelu]\n", 4, "torch.nn.functional.gelu cannot be fp8"),
    ("fp8:\n  torch: [mm]\nfp8_recipe: [rowwise]\n", 3, "fp8_recipe ['rowwise'] is not a recipe"),
])
def test_fp8_errors_name_the_file_and_line(tmp_path, text, line, fragment):
    path = _write(tmp_path, "bad.yaml", text)
    with pytest.raises(amp_patch.OpListError) as info:
        load_op_lists(path)
    assert str(info.value).startswith(f"{path}:{line}: ") and fragment in str(info.value), str(info.value)


def test_validate_accepts_the_shipped_fp8_lists_and_refuses_a_bad_one(tmp_path, capsys):
    assert cli.main(["validate", "fp8_linear_cpu", "fp8_linear_cuda_rowwise"]) == 0
    out = capsys.readouterr().out
    assert "fp8_linear_cpu: OK" in out and ", fp8 2 (tensorwise)," in out and ", fp8 2 (rowwise)," in out
    assert cli.main(["validate", "torch_cpu"]) == 0 and "fp8" not in capsys.readouterr().out
    bad = _write(tmp_path, "bad.yaml", "extends: fp8_linear_cpu\nfp8_recipe: rowise\n")
    assert cli.main(["validate", bad]) == 1
    assert f"{bad}:2: fp8_recipe 'rowise'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the wrapper

class _Twice(nn.Module):
    """One Linear called twice per forward (its weight is quantized once), then an odd-sized head."""

    def __init__(self, head_out=16):
        super().__init__()
        self.body, self.head = nn.Linear(32, 32), nn.Linear(32, head_out)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.body(x)))))


def _quantizations(monkeypatch):
    calls = []
    real = fp8_module.quantize_weight

    def counting(b, recipe):
        calls.append(tuple(b.shape))
        return real(b, recipe)

    monkeypatch.setattr(fp8_module, "quantize_weight", counting)
    return calls


@pytest.mark.parametrize("op_lists", ["fp8_linear_cpu", "fp8_linear_cpu_rowwise"])
def test_a_weight_is_quantized_once_per_forward_and_the_output_is_half(monkeypatch, op_lists):
    calls = _quantizations(monkeypatch)
    model = amp_patch.initialize(_Twice(), opt_level="O1", half_dtype=torch.bfloat16, op_lists=op_lists,
                                 verbosity=0)
    try:
        for _ in range(2):
            out = model(torch.randn(16, 32))
            out.float().sum().backward()
    finally:
        amp_patch.deinitialize()
    assert out.dtype == torch.bfloat16
    assert calls == [(32, 32), (32, 16)] * 2  # body once (called twice), head once; again in the next forward
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_odd_sizes_run_in_half_and_the_trace_counts_them():
    model = amp_patch.initialize(_Twice(head_out=10), opt_level="O1", half_dtype=torch.bfloat16,
                                 op_lists="fp8_linear_cpu", verbosity=0)
    try:
        with amp_patch.trace() as tracer:
            out = model(torch.randn(16, 32))
            out.float().sum().backward()
        x3 = torch.randn(2, 8, 32)  # [2, 8] rows: 16, a multiple of 16: fp8
        assert model.body(x3).shape == (2, 8, 32)
    finally:
        amp_patch.deinitialize()
    assert out.dtype == torch.bfloat16 and out.shape == (16, 10)
    rows = {row["module"]: row for row in tracer.report()}
    assert rows["body"]["category"] == "fp8" and rows["body"]["fp8"].startswith("fp8 2 (tensorwise), half "
                                                                                 "fallback 0; scales a ")
    assert ", b " in rows["body"]["fp8"]
    assert rows["head"]["fp8"] == "fp8 0, half fallback 1"  # N = 10: not a multiple of 16
    assert rows["head"]["casts"] == 2  # the half fallback casts the weight and bias


def test_deinitialize_restores_every_patched_linear():
    before = (F.linear, torch._C._nn.linear)
    model = amp_patch.initialize(nn.Linear(16, 16), opt_level="O1", half_dtype=torch.bfloat16,
                                 op_lists="fp8_linear_cpu", verbosity=0)
    assert F.linear is not before[0] and torch._C._nn.linear is not before[1]
    model(torch.randn(16, 16))
    amp_patch.deinitialize()
    assert (F.linear, torch._C._nn.linear) == before
    assert registry.installed() == []
    assert model(torch.randn(16, 16)).dtype == torch.float32


def test_fp8_mm_and_matmul_and_their_fallbacks():
    table = {"extends": "torch_cpu", "add": {"fp8": {"torch": ["mm", "matmul"], "torch.Tensor": ["__matmul__"]}}}
    torch.manual_seed(0)
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    with amp_patch.autocast(dtype=torch.bfloat16, op_lists=table):
        with amp_patch.trace(modules=False) as tracer:
            outs = [torch.mm(a, b), torch.matmul(a, b), a @ b, torch.matmul(torch.randn(2, 16, 32), b),
                    torch.matmul(torch.randn(2, 16, 32), torch.randn(2, 32, 16)), torch.mm(a.double(), b.double())]
    assert [o.dtype for o in outs] == [torch.bfloat16] * 5 + [torch.float64]
    rows = {row["qualname"]: row["fp8"] for row in tracer.report()}
    assert rows["torch.mm"].startswith("fp8 1 (tensorwise), half fallback 1; scales a ")  # fp64: as half does
    assert rows["torch.matmul"].startswith("fp8 2 (tensorwise), half fallback 1")  # batched @ batched: half
    assert rows["torch.Tensor.__matmul__"].startswith("fp8 1")
    # what the scaled matmul computes: the operands dequantized from e4m3 (one scale each), multiplied in fp32
    dequantized = [(t * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s
                   for t, s in ((a, 448 / a.abs().max()), (b, 448 / b.abs().max()))]
    torch.testing.assert_close(outs[0], (dequantized[0] @ dequantized[1]).bfloat16(), rtol=0.01, atol=0.01)


def test_compiled_fp8_matches_eager_without_graph_breaks():
    torch._dynamo.reset()
    model = amp_patch.initialize(_Twice(), opt_level="O1", half_dtype=torch.bfloat16, op_lists="fp8_linear_cpu",
                                 verbosity=0)
    x = torch.randn(16, 32)
    try:
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
        compiled = torch.compile(model, backend="eager")(x)
    finally:
        amp_patch.deinitialize()
        torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)


def test_a_scope_puts_one_modules_linear_in_fp8():
    spec = {"extends": "torch_cpu", "fp8_recipe": "rowwise", "scopes": {"head": LINEAR_IN_FP8}}
    model = amp_patch.initialize(_Twice(), opt_level="O1", half_dtype=torch.bfloat16, op_lists=spec, verbosity=0)
    try:
        with amp_patch.trace() as tracer:
            model(torch.randn(16, 32))
    finally:
        amp_patch.deinitialize()
    rows = {(row["module"], row["scope"]): (row["category"], row["fp8"]) for row in tracer.report()
            if row["qualname"] == "torch.nn.functional.linear"}
    assert rows[("body", "(global)")] == ("half", None)
    assert rows[("head", "head")][0] == "fp8" and rows[("head", "head")][1].startswith("fp8 1 (rowwise)")


# ------------------------------------------------------------------------------------------------ the tools

def test_the_machine_line_says_whether_float8_runs_on_hardware_when_a_list_uses_fp8():
    from types import SimpleNamespace

    from amp_patch.tools.experiment.report import machine_line
    from amp_patch.tools.machine import fp8_hardware

    config = SimpleNamespace(device="cpu", half_dtype=torch.bfloat16,
                             op_lists=(("torch_cpu", "torch_cpu"), ("fp8_linear_cpu", "fp8_linear_cpu")))
    assert machine_line(config).endswith("; float8 runs in software only (slower than fp32 and than hardware bf16) "
                                         "on this CPU (torch._scaled_mm's CPU kernel is a reference: numerics only)")
    assert "float8" not in machine_line(SimpleNamespace(device="cpu", half_dtype=torch.bfloat16,
                                                        op_lists=(("torch_cpu", "torch_cpu"),)))
    assert not fp8_hardware("cpu").native


class _Overflowing(nn.Module):
    """A Linear whose output is beyond float16's range: fp8 (out in fp16) and half both overflow, fp32 does not."""

    def __init__(self):
        super().__init__()
        self.up, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.up.weight.mul_(3e3)

    def forward(self, x):
        return self.head(self.up(x * 100.0) / 1e5)


def _overflow_job():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return {"model_fn": _Overflowing, "optimizer_fn": lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
            "data_fn": lambda: (x, torch.randint(0, 4, (64,), generator=g)), "batch_size": 16, "name": "fp8",
            "loss_fn": lambda out, y: F.cross_entropy(out.float(), y)}


def test_the_doctor_moves_an_fp8_culprit_out_of_fp8_half_first(tmp_path):
    out = tmp_path / "fixed.yaml"
    report = amp_patch.doctor(_overflow_job(), steps=4, op_lists="fp8_linear_cpu", out=out)
    first = report.culprits[0]
    assert (first["module"], first["op"], first["category"]) == ("up", "torch.nn.functional.linear", "fp8")
    tried = [line for line in report.log if line.startswith("try ")]
    assert tried[0].startswith("try torch.nn.functional.linear -> half in scope 'up'")  # out of fp8 first
    assert report.status == "fixed", report.log
    assert report.fixes == [{"target": "torch.nn.functional", "name": "linear", "scope": "up"}]  # then float
    table = load_op_lists(str(out))
    assert [(s.glob, [(e.qualname, e.category) for e in s.entries]) for s in table.scopes] == [
        ("up", [("torch.nn.functional.linear", "float")])]
    assert table.fp8_recipe == "tensorwise" and table.category_of("torch.nn.functional", "linear") == "fp8"
