"""Models passed to ``initialize`` together with one of their own submodules (OpenNMT-py's
``amp.initialize([model, model.generator], optimizer, opt_level=...)``), as Apex accepted them.

Each model passed gets its casts as Apex gave each listed model its own (O2/O3: floating inputs to the half
dtype, outputs to fp32; O1 with ``cast_model_outputs``: outputs to that dtype). The outer model casts the
params of the inner one with its own (the inner's cast finds them cast already), so each param has one master
whatever the order. Two call shapes:

- The inner model called on its own, outside the outer's forward (OpenNMT-py: the loss code calls
  ``model.generator`` on the model's fp32 outputs): its input cast turns them to half and its output cast back to
  fp32, exactly Apex's separate casts.
- The inner model called inside the outer model's forward: its output cast is skipped there (the outer's own
  output cast applies when the outer returns). Where Apex's fp32 inner outputs went straight to the outer's
  output, the values are the same bitwise (a half tensor widened once); where they reached a half layer of
  the outer, Apex raised a dtype mismatch, and amp_patch runs it in half as the outer's other layers run
  (docs/migration.md).

:func:`install` tracks, per thread, which outer models are inside a forward (a forward pre-hook, and a forward hook
torch calls even when the forward raises) and gives the inner models' ``CastOutputs`` hooks that predicate. A
forward cut off by Ctrl-C (a ``BaseException``: torch runs no hook after it) is found gone by its call's frame, no
longer running: it leaves the inner's output cast on, not off for the rest of the session.
"""
import threading

from .._torch.hooks import SessionHook, module_call_frame, running


def nested_pairs(models):
    """``[(inner index, outer index)]`` for every model passed that is a submodule of another one passed."""
    found = []
    for outer, model in enumerate(models):
        members = {id(m) for m in model.modules() if m is not model}
        found += [(inner, outer) for inner, other in enumerate(models) if id(other) in members]
    return found


class _OuterForwards(threading.local):
    """Per thread: the open forwards of each outer model (by id), as the frames of torch's calls running them (None
    where torch's call is not the known one: taken as running)."""

    def __init__(self):
        self.open = {}


class _Enter(SessionHook):
    def __init__(self, forwards):
        self.forwards = forwards

    def __call__(self, module, args):
        self.forwards.open.setdefault(id(module), []).append(module_call_frame(1))


class _Leave(SessionHook):
    def __init__(self, forwards):
        self.forwards = forwards

    def __call__(self, module, args, output):
        frames = self.forwards.open.get(id(module))
        if frames:
            frames.pop()  # (this call's: calls nest in a thread; cut-off ones below it go when found)
        if not frames:
            self.forwards.open.pop(id(module), None)


class InsideOuter(SessionHook):
    """``CastOutputs.skip`` of an inner model: true while one of its outer models' forwards is open in this thread
    (a copied or pickled model gets an inert hook, which casts)."""

    def __init__(self, forwards, outer_ids):
        self.forwards, self.outer_ids = forwards, outer_ids

    def __call__(self):
        open_ = self.forwards.open
        return any(_running_call(open_, i) for i in self.outer_ids if i in open_)


def _running_call(open_, outer_id):
    """Whether a forward of the outer model is running in this thread, dropping the cut-off ones found on top."""
    frames = open_[outer_id]
    while frames and frames[-1] is not None and not running(frames[-1]):
        frames.pop()
    if not frames:
        del open_[outer_id]
    return bool(frames)


def install(session, models):
    """Skip the inner models' output casts inside their outer models' forwards (see the module docstring)."""
    pairs = nested_pairs(models)
    if not pairs:
        return
    forwards = _OuterForwards()
    handles = []
    session.undo.append(lambda: [handle.remove() for handle in handles])  # first: an interrupt leaves no hook
    for outer in sorted({o for _, o in pairs}):
        handles.append(models[outer].register_forward_pre_hook(_Enter(forwards), prepend=True))
        handles.append(models[outer].register_forward_hook(_Leave(forwards), always_call=True))
    patches = {id(patch.model): patch for patch in session.casting.model_patches}
    for inner in sorted({i for i, _ in pairs}):
        patch = patches.get(id(models[inner]))
        outer_ids = frozenset(id(models[o]) for i, o in pairs if i == inner)
        for cast in patch.output_casts if patch is not None else ():
            cast.skip = InsideOuter(forwards, outer_ids)
