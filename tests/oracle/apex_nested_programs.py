"""Programs passing a model together with its own submodule to ``amp.initialize`` (OpenNMT-py's ``[model,
model.generator]``), run by any ``amp`` module (real ``apex.amp`` or amp_patch's alias): O2 and O3, either
order, the generator called on the model's outputs outside its forward (``separate``), or inside it as its
last layer (``inside_last``) or followed by another of its layers (``inside_mid``). Each returns a trace as
:mod:`apex_programs` does (losses, scales, master params after each step; ``("raised", ...)`` where it raised).
This module imports only torch: the real-Apex child imports it too."""
import torch


class Translator(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.encoder = torch.nn.Linear(6, 8)
        self.generator = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.LogSoftmax(dim=-1))
        self.after = torch.nn.Linear(5, 5)

    def forward(self, x):
        hidden = torch.tanh(self.encoder(x))
        if self.shape == "separate":
            return hidden
        out = self.generator(hidden)
        return out if self.shape == "inside_last" else self.after(out)


PROGRAMS = [{"opt_level": level, "shape": shape, "inner_first": first, "optim": optim}
            for level in ("O2", "O3") for shape in ("separate", "inside_last", "inside_mid")
            for first in (False, True) for optim in (("sgd", "adam") if level == "O2" else ("sgd",))]


def describe(program):
    return " ".join(f"{k}={v!r}" for k, v in program.items())


def run(amp, program, steps=3):
    torch.manual_seed(0)
    model = Translator(program["shape"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if program["optim"] == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    models = [model.generator, model] if program["inner_first"] else [model, model.generator]
    trace = []
    try:
        models, opt = amp.initialize(models, opt, opt_level=program["opt_level"], verbosity=0)
        for s in range(steps):
            torch.manual_seed(100 + s)
            out = model(torch.randn(4, 6))
            if program["shape"] == "separate":
                out = model.generator(out)
            trace.append((f"step {s} output dtype", str(out.dtype)))
            loss = out.float().pow(2).mean()
            trace.append((f"step {s} loss", loss.item()))
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            trace.append((f"step {s} scale", float(amp._amp_state.loss_scalers[0].loss_scale())))
            for j, p in enumerate(amp.master_params(opt)):
                trace.append((f"step {s} master {j}", p.detach().clone()))
    except Exception as exc:  # noqa: BLE001 - the trace records where a run raised
        trace.append(("raised", f"{type(exc).__name__}: {str(exc)[:200]}"))
    return trace


def run_all(amp):
    return [run(amp, program) for program in PROGRAMS]
