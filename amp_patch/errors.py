"""Exception classes of amp_patch.

Every class subclasses both :class:`AmpPatchError` and the built-in exception a
user would naturally catch (``ValueError`` for bad input, ``RuntimeError`` for
misuse at run time), so ``except ValueError`` keeps working in legacy scripts.
"""


class AmpPatchError(Exception):
    """Base class of every error amp_patch raises on purpose."""


class OpListError(AmpPatchError, ValueError):
    """A malformed op list. The message starts with ``path:line:``."""

    def __init__(self, path, line, message, entry=None):
        self.path = str(path)
        self.line = line
        self.entry = entry
        super().__init__(f"{self.path}:{line if line is not None else '?'}: {message}")


class ConfigError(AmpPatchError, ValueError):
    """An invalid argument to ``initialize`` or another entry point."""


class JobError(ConfigError):
    """A ``--job`` function that raised: the message names the job, the exception and the user's ``file:line``;
    ``details`` holds the full traceback (what ``--verbose`` prints)."""

    def __init__(self, message, details=""):
        super().__init__(message)
        self.details = details


class UnexpectedKeysError(ConfigError, RuntimeError):
    """A state dict with keys nothing reads (also a ``RuntimeError``, which Apex's ``amp.load_state_dict`` raised)."""


class UsageError(AmpPatchError, RuntimeError):
    """amp_patch used in the wrong order or on the wrong objects."""


class BannedOpError(AmpPatchError, NotImplementedError):
    """A banned op (e.g. ``F.binary_cross_entropy`` in half) was called.

    Also a ``NotImplementedError`` (a ``RuntimeError`` subclass), which is what Apex raised.
    """


class CastError(AmpPatchError, NotImplementedError):
    """A cast amp_patch refuses to do (e.g. an fp32-only in-place op on a half tensor).

    Also a ``NotImplementedError``, which is what Apex raised for in-place float-list ops on half tensors.
    """


class NotInitializedError(UsageError, AttributeError):
    """Live state read before ``initialize`` created it (e.g. ``apex.amp._amp_state.loss_scalers``).

    Also an ``AttributeError``, so ``hasattr``/``getattr(..., default)`` keep answering.
    """


class PatchError(AmpPatchError, RuntimeError):
    """A patch site could not be installed or restored exactly."""


class MissingDependencyError(AmpPatchError, ImportError):
    """An optional integration (e.g. ``amp_patch.integrations.lightning``) needs a package that is not installed."""


class TorchVersionError(AmpPatchError, RuntimeError):
    """This torch lacks an internal amp_patch reads (dynamo's trace rules, ...): the message names the torch version,
    what is missing and the tested range (amp_patch._torch.compat)."""


class ExperimentInterrupted(KeyboardInterrupt):
    """Ctrl-C during an experiment. ``reports``: the jobs' reports with the rounds that finished (a report cut
    short has ``"partial": True`` and its unfinished variants the status ``interrupted``). A KeyboardInterrupt,
    so code that handles Ctrl-C keeps doing so."""

    def __init__(self, reports):
        super().__init__("interrupted")
        self.reports = reports
