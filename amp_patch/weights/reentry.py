"""Code of an O2 call that runs outside its extent re-enters it (see :mod:`.compute_copies`): a checkpointed
segment's recomputation (:class:`Reentered`: fresh copies, unless a call is in progress in the thread) and each
resumption of a generator the forward returned (:class:`Resumed`: on the call's own copies)."""
from . import thread_params


class Reentered:
    def __init__(self, copies, called, frame=None):
        self.copies, self.called, self.frame, self.entered = copies, called, frame, False

    def __enter__(self):
        copies = self.copies
        if copies.live and copies.in_call() is None:
            copies.install(self.called, self.frame)
            self.entered = True
        return self

    def __exit__(self, *exc):
        if self.entered:
            self.copies.uninstall()
        return False


class Resumed:
    def __init__(self, copies, called, kept):
        self.copies, self.called, self.kept, self.entered = copies, called, kept, False

    def __enter__(self):
        copies, state = self.copies, self.copies.call
        if not copies.live or state.depth:
            return self
        state.depth, state.called, self.entered = 1, self.called, True
        copies.count_call(1)
        touched = set()
        for module, params, name, param, copy, _ in self.kept:
            if dict.get(params, name) is param and isinstance(params, thread_params.ThreadParams):
                params.overlay()[name] = copy
                state.swapped.append((module, params, name, param, copy, copy._version))
                touched.add(module)
        thread_params.refresh_flat_weights(touched)
        return self

    def __exit__(self, *exc):
        if self.entered:
            self.copies.uninstall()
        return False


def resumed_in_call(copies, called, kept, generator):
    """A generator forward's body runs at each resumption, after its call returned: each runs in the call, on
    the call's copies."""
    try:
        while True:
            with copies.resume(called, kept):
                try:
                    item = next(generator)
                except StopIteration as stop:
                    return stop.value
            yield item
    finally:
        generator.close()
