"""O1's step pause and resume do the usual case in one frame (the switch's enter/exit and the fast regions' sync
inline): random sequences of pauses, resumes, forwards, ``casts_disabled()`` blocks and user ``torch.autocast``
regions leave the switch, the matching wrappers' switch, the fast regions and native autocast's state exactly as
the general calls (``DisabledThreads.enter``/``exit``, each followed by ``FastRegions.sync``) leave them."""
import random

import pytest
import torch

import amp_patch
from amp_patch.casting import engine as engine_module
from amp_patch.session import state

OPS = ["pause", "resume", "resume", "begin", "end", "off", "on", "native", "native_end"]


def _general_pause(self):
    if self.outer_calls:
        self.drop_cut_off()
    ident = engine_module.threading.get_ident()
    if ident not in self.paused:
        self.paused.add(ident)
        self.disabled.enter()


def _general_resume(self):
    ident = engine_module.threading.get_ident()
    if self.paused and ident in self.paused:
        self.paused.discard(ident)
        self.disabled.exit()


def _snapshot(engine):
    fast = engine.fast
    return (dict(engine.disabled), dict(fast.bypass), set(engine.paused), dict(fast.depth), set(fast.saved),
            torch._C.is_autocast_enabled("cpu"), torch._C.get_autocast_dtype("cpu"))


def _run(program):
    model = torch.nn.Linear(2, 2)
    amp_patch.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    engine, seen, open_off, regions = state.current().casting.engine, [], [0], []
    try:
        for op in program:
            if op == "pause":
                engine.pause_for_step()
            elif op == "resume":
                engine.resume_after_step()
            elif op == "begin":
                engine.begin_forward(model, ())
            elif op == "end":
                engine.end_forward(model, (), None)
            elif op == "off":
                engine.casts_disabled().__enter__()
                open_off[0] += 1
            elif op == "on" and open_off[0]:
                engine.casts_disabled().__exit__(None, None, None)
                open_off[0] -= 1
            elif op == "native":
                regions.append(torch.autocast("cpu", dtype=torch.float16))
                regions[-1].__enter__()
            elif op == "native_end" and regions:
                regions.pop().__exit__(None, None, None)
            seen.append(_snapshot(engine))
    finally:
        while regions:
            regions.pop().__exit__(None, None, None)
        amp_patch.deinitialize()
    return seen


@pytest.mark.parametrize("seed", range(40))
def test_the_usual_pause_and_resume_leave_what_the_general_calls_leave(seed, monkeypatch):
    rng = random.Random(seed)
    program = [rng.choice(OPS) for _ in range(30)]
    inline = _run(program)
    monkeypatch.setattr(engine_module.CastingEngine, "pause_for_step", _general_pause)
    monkeypatch.setattr(engine_module.CastingEngine, "resume_after_step", _general_resume)
    general = _run(program)
    for i, (got, want) in enumerate(zip(inline, general)):
        assert got == want, f"after op {i} ({program[i]}) of {program}"
