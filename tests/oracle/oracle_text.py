"""A :class:`oracle_program.Program` written out as Python-like text (what a failing oracle test prints)."""
import textwrap

from oracle_program import BUF_DTYPES, DTYPES, OPS

PARAM_NAMES = ("w", "b", "lin.0.weight", "lin.0.bias", "lin.1.weight", "lin.1.bias", "conv.weight", "conv.bias",
               "ln.weight", "ln.bias")
LOSS_TEXT = {"mse": "F.mse_loss(out, y)", "l1": "F.l1_loss(out, y)", "smooth_l1": "F.smooth_l1_loss(out, y)",
             "cross_entropy": "F.cross_entropy(out, y)", "sum": "(out * out).sum()"}
OPTIM_TEXT = {"sgd": "torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)",
              "adam": "torch.optim.Adam(model.parameters(), lr=0.01)"}
DATA_TEXT = ("model.{p}.data = randn_like(model.{p}, seed={s})",
             "model.{p}.data.copy_(randn_like(model.{p}, seed={s}))",
             "torch.nn.utils.vector_to_parameters(randn(n_params, seed={s}), model.parameters())",
             "for p in model.parameters(): p.data.clamp_(-0.2, 0.2)",
             "with torch.no_grad(): model.{p}.mul_(0.5)",
             "with torch.no_grad(): model.{p}.set_(randn_like(model.{p}, seed={s}))")
SD_TEXT = ("model.load_state_dict(model.state_dict())",
           "model.load_state_dict({{k: randn_like(v, seed={s}+i) for i, (k, v) in enumerate(sd.items())}})",
           "torch.save(model.state_dict(), f); model.load_state_dict(torch.load(f))")


def _op_lines(ops, seg_counter):
    lines = []
    for op in ops:
        if op.kind == "ckpt":
            seg_counter[0] += 1
            name = f"seg{seg_counter[0]}"
            body = _op_lines(op.inner, seg_counter) + ["return x"]
            lines.append(f"def {name}(x):")
            lines += ["    " + line for line in body]
            lines.append(f"x = checkpoint({name}, x, use_reentrant={op.arg == 0})")
            continue
        if op.kind in ("fp32_region", "torch_off"):
            lines.append("with fp32_region():  # torch.autocast('cpu', enabled=False) / amp_patch.disable_casts()"
                         if op.kind == "fp32_region" else "with torch.autocast('cpu', enabled=False):  # every run")
            lines += ["    " + line for line in ["x = x.float()"] + _op_lines(op.inner, seg_counter)]
            continue
        text = OPS[op.kind][1].format(a=op.arg, buf=BUF_DTYPES[op.arg] if op.kind.startswith("out_") else "")
        lines += text.split("\n")
    return lines


def _train_lines(program, n, seed):
    div = f" / {n}" if n > 1 else ""
    return ["optimizer.zero_grad()",
            f"for x, y in batches(seeds={list(range(seed, seed + n))}):",
            "    with region():  # torch.autocast for native, nothing for amp_patch and fp32",
            "        out = model(x)",
            f"        loss = {LOSS_TEXT[program.loss]}{div}",
            f"    backward(loss)  # amp_patch.scale_loss / (loss.float() * {program.scale}).backward() / plain",
            "record(grads); optimizer.step(); record(model.state_dict())"]


def _step_lines(program, step):
    kind, args = step.kind, step.args
    if kind == "train":
        return _train_lines(program, *args)
    if kind == "eval":
        mode = ("torch.no_grad(), ", "torch.inference_mode(), ", "")[args[1]]
        note = "  # grad on, no backward" if args[1] == 2 else ""
        return [f"with {mode}region():{note}", f"    record(model(batch(seed={args[0]})))"]
    if kind == "freeze":
        return [f"model.{PARAM_NAMES[args[0]]}.requires_grad_({bool(args[1])})"]
    if kind == "data":
        how, target, seed = args
        return [DATA_TEXT[how].format(p=PARAM_NAMES[target], s=seed)]
    if kind == "deepcopy":
        return ["clone = copy.deepcopy(model)",
                f"with torch.no_grad(), region(): record(clone(batch(seed={args[0]})))",
                f"clone.load_state_dict(randn state dict, seed={args[0] + 1})",
                "record(clone.state_dict(), model.state_dict())",
                f"with torch.no_grad(), region(): record(model(batch(seed={args[0]})), clone(batch(seed={args[0]})))"]
    how, seed = args
    return [SD_TEXT[how].format(s=seed), "record(model.state_dict())"]


def render(program):
    half = str(DTYPES[program.dtype]).replace("torch.", "")
    head = [f"# oracle program: half dtype {half}, loss scale {program.scale}, model seed {program.seed}",
            "# features: " + (", ".join(program.features()) or "base"),
            "class Net(OracleNet):  # lin0, lin1: Linear(4, 4); conv: Conv1d(1, 1, 3, padding=1); ln: LayerNorm(4);"
            " w: (4, 4); b: (4,)",
            "    def forward(self, x):"]
    body = ["        " + line for line in _op_lines(program.ops, [0]) + ["return x"]]
    setup = ["model = Net()", f"optimizer = {OPTIM_TEXT[program.optim]}",
             "# fp32: as is; native: region() is torch.autocast('cpu', dtype); amp_patch: initialize(model, opt, ...)"]
    steps = []
    for i, step in enumerate(program.steps):
        steps.append(f"# step {i}")
        steps += _step_lines(program, step)
    return "\n" + textwrap.indent("\n".join(head + body + setup + steps), "    ") + "\n"
