"""O2 programs where a step's loss reaches only some of an optimizer's params (or none), run by any ``amp``
module (real ``apex.amp`` or amp_patch's alias): a model with a BatchNorm (kept fp32 under O2) and a head, SGD
with momentum and weight decay, ``optimizer.zero_grad()`` before each step. Apex's O2 ``zero_grad`` zeroed the
grads of the optimizer's fp32 params in place, so a step that no loss reached still applied momentum and weight
decay to them. The trace is :mod:`apex_programs`'s (losses, model params and masters after each step)."""
import torch

# (steps whose loss goes through the BatchNorm, or only through the head, or is absent)
PROGRAMS = [{"steps": steps, "optim": optim} for steps in (("all", "head", "all"), ("all", "none", "head"))
            for optim in ("sgd", "adam")]


def describe(program):
    return " ".join(f"{k}={v!r}" for k, v in program.items())


def run(amp, program):
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    head = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in [*body.parameters(), *head.parameters()]:
            p.copy_(p.half().float())
    params = [*body.parameters(), *head.parameters()]
    opt = (torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1) if program["optim"] == "sgd"
           else torch.optim.AdamW(params, lr=0.01, weight_decay=0.1))
    trace = []
    try:
        (body, head), opt = amp.initialize([body, head], opt, opt_level="O2", loss_scale=128.0, verbosity=0)
        for s, kind in enumerate(program["steps"]):
            torch.manual_seed(10 + s)
            x = torch.randn(8, 4)
            opt.zero_grad()
            if kind != "none":
                out = head(x) if kind == "head" else body(x).float()[:, :2] + head(x)
                loss = out.float().pow(2).mean()
                trace.append((f"step {s} loss", loss.item()))
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()
            for i, model in enumerate((body, head)):
                for name, value in model.named_parameters():
                    trace.append((f"step {s} model {i} {name}", value.detach().clone()))
            for j, p in enumerate(amp.master_params(opt)):
                trace.append((f"step {s} master {j}", p.detach().clone()))
    except Exception as exc:  # noqa: BLE001 - the trace records where a run raised
        trace.append(("raised", f"{type(exc).__name__}: {str(exc)[:200]}"))
    return trace


def run_all(amp):
    return [run(amp, program) for program in PROGRAMS]
