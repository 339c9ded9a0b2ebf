"""The differential oracle's program representation: a small model whose forward is a list of ops, and the steps
a training script runs on it.

A :class:`Program` is plain data (tuples of strings and ints), so hypothesis can generate and shrink it, and its
``repr`` is the program written out as Python-like text (what a failing test prints). The same program is run by
every runner in ``oracle_run``; only the way precision is handled differs between them.

Each op and step kind belongs to a *feature* (``FEATURES``); ``None`` is the base set every program may use.
"""
import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

FEATURES = ("inplace", "views", "out", "data_write", "no_grad", "checkpoint", "multi_backward", "deepcopy",
            "state_dict", "fp32_region", "freeze", "grad_eval", "torch_off")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BUF_DTYPES = ("torch.float32", "half", "x.dtype")  # the dtype of an out= buffer, by the op's arg


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str
    arg: int = 0
    inner: tuple = ()  # the ops of a checkpointed segment ("ckpt") or a casting-off region ("fp32_region", "torch_off")


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str
    args: tuple = ()


def _buf(x, arg, half, shape=(2, 4)):
    dtype = (torch.float32, half, x.dtype)[arg]
    return torch.full(shape, 7.0, dtype=dtype)


def _out_op(call, shape=(2, 4), take=lambda buf: buf):
    """An op computing a side result into a caller-made buffer under no_grad, then adding it to x."""
    def run(m, x, arg):
        with torch.no_grad():
            buf = _buf(x, arg, m.half_dtype, shape)
            call(m, x.detach(), buf)
        return x + take(buf)
    return run


def _inplace(fn):
    def run(m, x, arg):
        x = x.clone()
        fn(m, x)
        return x
    return run


@torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
def fp32_mm(x, w):
    """A custom op written for native autocast: inputs cast to fp32, autocast off inside."""
    return torch.mm(x, w)


def _iadd(m, x, arg):
    x = x.clone()
    x += m.b
    return x


# kind -> (feature, text (``{a}`` is the op's arg, ``{buf}`` the buffer dtype), function(model, x, arg) -> x)
OPS = {
    "lin": (None, "x = self.lin{a}(x)", lambda m, x, a: m.lin[a](x)),
    "mm": (None, "x = torch.mm(x, self.w)", lambda m, x, a: torch.mm(x, m.w)),
    "F.linear": (None, "x = F.linear(x, self.w, self.b)", lambda m, x, a: F.linear(x, m.w, m.b)),
    "matmul": (None, "x = torch.matmul(x, self.w)", lambda m, x, a: torch.matmul(x, m.w)),
    "@": (None, "x = x @ self.w", lambda m, x, a: x @ m.w),
    "addmm": (None, "x = torch.addmm(self.b, x, self.w)", lambda m, x, a: torch.addmm(m.b, x, m.w)),
    "conv1d": (None, "x = self.conv(x.unsqueeze(1)).squeeze(1)", lambda m, x, a: m.conv(x.unsqueeze(1)).squeeze(1)),
    "sdpa": (None, "q = x.unsqueeze(0); x = F.scaled_dot_product_attention(q, q, q).squeeze(0)",
             lambda m, x, a: F.scaled_dot_product_attention(x[None], x[None], x[None]).squeeze(0)),
    "tanh": (None, "x = torch.tanh(x)", lambda m, x, a: torch.tanh(x)),
    "relu": (None, "x = F.relu(x)", lambda m, x, a: F.relu(x)),
    "gelu": (None, "x = F.gelu(x)", lambda m, x, a: F.gelu(x)),
    "softmax": (None, "x = F.softmax(x, dim=-1)", lambda m, x, a: F.softmax(x, dim=-1)),
    "layer_norm": (None, "x = self.ln(x)", lambda m, x, a: m.ln(x)),
    "add_b": (None, "x = x + self.b", lambda m, x, a: x + m.b),
    "sum": (None, "x = x + x.sum(1, keepdim=True)", lambda m, x, a: x + x.sum(1, keepdim=True)),
    "prod": (None, "x = x + torch.prod(x, 1, keepdim=True)", lambda m, x, a: x + torch.prod(x, 1, keepdim=True)),
    "mse_scale": (None, "x = x * F.mse_loss(x, self.b.expand(2, 4))",
                  lambda m, x, a: x * F.mse_loss(x, m.b.expand(2, 4))),
    "cat": (None, "x = torch.cat([x, self.w[:1]])[1:]", lambda m, x, a: torch.cat([x, m.w[:1]])[1:]),
    "stack": (None, "x = torch.stack([x, self.w[:2]]).sum(0)", lambda m, x, a: torch.stack([x, m.w[:2]]).sum(0)),
    "index_copy": (None, "x = x.index_copy(0, torch.tensor([1]), self.w[:1])",
                   lambda m, x, a: x.index_copy(0, torch.tensor([1]), m.w[:1])),
    "add_": ("inplace", "x = x.clone(); x.add_(self.b)", _inplace(lambda m, x: x.add_(m.b))),
    "iadd": ("inplace", "x = x.clone(); x += self.b", _iadd),
    "view_mul_": ("inplace", "x = x.clone(); x[:, :2].mul_(2)", _inplace(lambda m, x: x[:, :2].mul_(2))),
    "sigmoid_": ("inplace", "x = x.clone(); x.sigmoid_()", _inplace(lambda m, x: x.sigmoid_())),
    "custom_fwd_mm": ("torch_off", "x = fp32_mm(x, self.w)  # @torch.amp.custom_fwd(cast_inputs=torch.float32)",
                      lambda m, x, a: fp32_mm(x, m.w)),
    "t_mm": ("views", "x = torch.mm(x, self.w.t())", lambda m, x, a: torch.mm(x, m.w.t())),
    "slice_mm": ("views", "x = torch.cat([torch.mm(x[:, :2], self.w[2:]), x], 1)[:, :4]",
                 lambda m, x, a: torch.cat([torch.mm(x[:, :2], m.w[2:]), x], 1)[:, :4]),
    "perm": ("views", "x = x.view(2, 2, 2).transpose(1, 2).reshape(2, 4)",
             lambda m, x, a: x.view(2, 2, 2).transpose(1, 2).reshape(2, 4)),
    "bmm": ("views", "x = torch.bmm(x.unsqueeze(0), self.w.unsqueeze(0)).squeeze(0)",
            lambda m, x, a: torch.bmm(x.unsqueeze(0), m.w.unsqueeze(0)).squeeze(0)),
    "out_mm": ("out", "with torch.no_grad():\n    buf = torch.full((2, 4), 7.0, dtype={buf})\n"
               "    torch.mm(x.detach(), self.w, out=buf)\nx = x + buf",
               _out_op(lambda m, x, buf: torch.mm(x, m.w, out=buf))),
    "out_matmul": ("out", "with torch.no_grad():\n    buf = torch.full((2, 4), 7.0, dtype={buf})\n"
                   "    torch.matmul(x.detach(), self.w, out=buf)\nx = x + buf",
                   _out_op(lambda m, x, buf: torch.matmul(x, m.w, out=buf))),
    "out_add": ("out", "with torch.no_grad():\n    buf = torch.full((2, 4), 7.0, dtype={buf})\n"
                "    torch.add(x.detach(), self.b, out=buf)\nx = x + buf",
                _out_op(lambda m, x, buf: torch.add(x, m.b, out=buf))),
    "out_sum": ("out", "with torch.no_grad():\n    buf = torch.full((2, 1), 7.0, dtype={buf})\n"
                "    torch.sum(x.detach(), 1, keepdim=True, out=buf)\nx = x + buf",
                _out_op(lambda m, x, buf: torch.sum(x, 1, keepdim=True, out=buf), (2, 1))),
    "out_cat": ("out", "with torch.no_grad():\n    buf = torch.full((3, 4), 7.0, dtype={buf})\n"
                "    torch.cat([x.detach(), self.w[:1]], out=buf)\nx = x + buf[1:]",
                _out_op(lambda m, x, buf: torch.cat([x, m.w[:1]], out=buf), (3, 4), lambda buf: buf[1:])),
}
OP_ARGS = {"lin": 2, "out_mm": 3, "out_matmul": 3, "out_add": 3, "out_sum": 3, "out_cat": 3, "ckpt": 2}


class OracleNet(torch.nn.Module):
    """Every parameter a program may use; the forward runs ``self.ops``. A runner sets ``fp32_region`` to its
    way of turning casting off (``torch.autocast("cpu", enabled=False)``, ``amp_patch.disable_casts()``)."""

    fp32_region = staticmethod(contextlib.nullcontext)

    def __init__(self, ops, half_dtype):
        super().__init__()
        self.ops = tuple(ops)
        self.half_dtype = half_dtype
        self.lin = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.conv = torch.nn.Conv1d(1, 1, 3, padding=1)
        self.ln = torch.nn.LayerNorm(4)
        self.w = torch.nn.Parameter(torch.randn(4, 4) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(4) * 0.5)

    def forward(self, x):
        return self.run_ops(self.ops, x)

    def run_ops(self, ops, x):
        for op in ops:
            if op.kind == "ckpt":
                x = checkpoint(_Segment(self, op.inner), x, use_reentrant=op.arg == 0)
            elif op.kind == "fp32_region":
                with self.fp32_region():
                    x = self.run_ops(op.inner, x.float())
            elif op.kind == "torch_off":  # code written for native autocast (transformers' rotary embeddings)
                with torch.autocast("cpu", enabled=False):
                    x = self.run_ops(op.inner, x.float())
            else:
                x = OPS[op.kind][2](self, x, op.arg)
        return x


class _Segment:
    """A checkpointed segment's function (a class, not a closure: deepcopy and pickling see plain data)."""

    def __init__(self, model, ops):
        self.model, self.ops = model, ops

    def __call__(self, x):
        return self.model.run_ops(self.ops, x)


def build_model(program):
    torch.manual_seed(program.seed)
    return OracleNet(program.ops, DTYPES[program.dtype])


def batch(seed, loss):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, generator=gen)
    y = torch.randint(0, 4, (2,), generator=gen) if loss == "cross_entropy" else torch.randn(2, 4, generator=gen)
    return x, y


def random_like(seed, tensor):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tensor.shape, generator=gen) * 0.5).to(tensor.dtype)


@dataclasses.dataclass(frozen=True)
class Program:
    dtype: str = "bf16"
    ops: tuple = (Op("lin"),)
    steps: tuple = (Step("train", (1, 0)),)
    loss: str = "mse"
    optim: str = "sgd"
    scale: float = 1.0
    seed: int = 0

    def features(self):
        """The features this program uses (so a test can say which class a failure belongs to)."""
        compound = {"ckpt": "checkpoint", "fp32_region": "fp32_region", "torch_off": "torch_off"}
        used = {compound[op.kind] if op.kind in compound else OPS[op.kind][0] for op in _flat(self.ops)}
        used |= {STEP_FEATURES[s.kind] for s in self.steps}
        used |= {"grad_eval" for s in self.steps if s.kind == "eval" and s.args[1] == 2}
        used |= {"multi_backward" for s in self.steps if s.kind == "train" and s.args[0] > 1}
        return sorted(f for f in used if f)

    def __repr__(self):
        from oracle_text import render
        return render(self)


def _flat(ops):
    for op in ops:
        yield op
        yield from _flat(op.inner)


STEP_FEATURES = {"train": None, "eval": "no_grad", "data": "data_write", "deepcopy": "deepcopy",
                 "state_dict": "state_dict", "freeze": "freeze"}
