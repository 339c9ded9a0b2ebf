"""What one session keeps about casting: its ``casting`` part (the engine, the model patches, early-bound routes).

Filled by ``initialize`` (``session.api``), which registers each undo step (the engine's ``uninstall``, each model
patch's ``restore``, :meth:`CastingState.drop_early_bound`) in the session's one ordered undo list as it acts.
Nothing here reads the session: the models to reroute are passed in.
"""
from ..patching import early_bound


class CastingState:
    """Casting fields of one session."""

    def __init__(self):
        self.engine = None  # the session's CastingEngine (O1), or None
        self.model_patches = []  # model.transform.ModelPatch per cast model (O0/O2/O3)
        self.rerouted = []  # early-bound module attributes routed through the wrappers
        self._early_undo = None

    def clear_cache(self):
        if self.engine is not None:
            self.engine.clear_cache()

    def refresh_early_bound(self, models):
        """(Re)point early-bound function attributes of ``models`` at the current wrappers."""
        self.drop_early_bound()
        self._early_undo, self.rerouted = early_bound.reroute(models, self.engine)

    def drop_early_bound(self):
        """Undo step: the early-bound attributes point at the originals again."""
        undo, self._early_undo = self._early_undo, None
        if undo is not None:
            undo()

    def reset(self):
        """After every undo step ran: forget the engine and the (restored) model patches."""
        self.model_patches.clear()
        self.engine = None
