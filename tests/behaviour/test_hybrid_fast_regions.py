"""The hybrid O1 engine turns native autocast on only inside forwards of the session's models, in the thread that
runs them, and leaves torch's autocast state as it found it; everywhere else (other threads, outside forwards,
under a tracer) the Python wrappers cast as before."""
import threading

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch.errors import ConfigError
from amp_patch.session.state import active_engine

_native_on = torch._C.is_autocast_enabled  # torch's own answer (the patched torch.is_autocast_enabled answers
# as the Python path does inside a fast region)


class _Probe(torch.nn.Module):
    def __init__(self, fail=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.fail = fail
        self.seen = []

    def forward(self, x):
        self.seen.append((_native_on("cpu"), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        out = self.lin(x)
        if self.fail:
            raise RuntimeError("boom")
        return out


def test_native_autocast_is_on_only_inside_the_forward_and_answers_as_the_python_path():
    model = amp_patch.initialize(_Probe(), opt_level="O1", half_dtype=torch.float16, verbosity=0)
    before = (_native_on("cpu"), torch.get_autocast_dtype("cpu"))
    out = model(torch.randn(2, 4))
    assert out.dtype is torch.float16
    assert model.seen == [(True, False, torch.float16)]
    assert (_native_on("cpu"), torch.get_autocast_dtype("cpu")) == before
    assert F.linear(torch.randn(2, 4), model.lin.weight).dtype is torch.float16  # outside: the Python wrapper


def test_the_python_engine_never_turns_native_autocast_on():
    model = amp_patch.initialize(_Probe(), opt_level="O1", verbosity=0, cast_engine="python")
    assert model(torch.randn(2, 4)).dtype is torch.float16
    assert model.seen == [(False, False, torch.get_autocast_dtype("cpu"))]
    assert active_engine().fast is None


def test_a_forward_that_raised_turns_native_autocast_off():
    model = _Probe(fail=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4))
    assert not _native_on("cpu")
    model.fail = False
    loss = model(torch.randn(2, 4)).float().sum()
    with amp_patch.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert not _native_on("cpu")
    amp_patch.deinitialize()
    assert not _native_on("cpu")


def test_another_thread_casts_through_the_wrappers_while_a_forward_runs():
    results = {}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            def other():
                results["native"] = _native_on("cpu")
                results["dtype"] = F.linear(torch.randn(2, 4), self.lin.weight).dtype
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            return self.lin(x)

    model = amp_patch.initialize(Model(), opt_level="O1", verbosity=0)
    assert model(torch.randn(2, 4)).dtype is torch.float16
    assert results == {"native": False, "dtype": torch.float16}


def test_under_a_tracer_every_op_takes_the_python_path():
    model = amp_patch.initialize(_Probe(), opt_level="O1", verbosity=0)
    with amp_patch.trace() as tracer:
        model(torch.randn(2, 4))
    assert model.seen[-1][0] is False  # no fast region while recording
    assert any("linear" in str(key) for key in tracer.rows)  # the Python wrapper recorded it
    model(torch.randn(2, 4))
    assert model.seen[-1][0] is True  # back after the trace


def test_an_unknown_cast_engine_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="cast_engine='native'.*'hybrid'.*'python'"):
        amp_patch.initialize(_Probe(), opt_level="O1", verbosity=0, cast_engine="native")


@pytest.mark.parametrize("engine", ["hybrid", "python"])
def test_a_thread_reusing_the_ident_of_one_that_died_inside_a_forward_casts_as_a_new_thread(engine):
    """A worker thread whose forward raised and that then ended leaves its count under its ident (nothing of that
    thread forgets it); a later thread that gets the same ident from the OS casts as any new thread does."""
    model = amp_patch.initialize(_Probe(), opt_level="O1", half_dtype=torch.float16, verbosity=0,
                                 cast_engine=engine)
    dead, seen = set(), []

    def dies():
        dead.add(threading.get_ident())
        model.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 4))

    def runs():
        model.seen.clear()
        seen.append((threading.get_ident() in dead, model(torch.randn(2, 4)).dtype, list(model.seen),
                     _native_on("cpu")))

    try:
        _in_thread(dies)
        model.fail = False
        for _ in range(50):  # (the OS reuses a finished thread's ident for a later thread: usually at once)
            _in_thread(runs)
            if seen[-1][0]:
                break
        else:
            pytest.skip("no later thread got the dead thread's ident from the OS")
    finally:
        amp_patch.deinitialize()
    native = engine == "hybrid"
    assert seen[-1][1:] == (torch.float16, [(native, False, torch.float16 if native else torch.get_autocast_dtype(
        "cpu"))], False)


def _in_thread(fn):
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()
