"""The variants an experiment compares (fp32/O0, O1, O2, O3 through amp_patch; native torch.autocast) and the
counters it runs one iteration under (casts via a dispatch mode, host-device syncs via CUDA's sync debug mode)."""
import contextlib
import os
import re
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amp_patch

from ...config.oplist import load_op_lists
from ...errors import ConfigError

VARIANTS = ("fp32", "O1", "O2", "O3", "native")
#: opt-in variants (named in ``variants=``/``--variants``, not run by default): initialize's extra keywords
EXTRA_VARIANTS = {"O2-remainder": dict(opt_level="O2", master_weights="remainder")}
_TO_COPY = torch.ops.aten._to_copy.default


def parse_variants(variants):
    """Canonical variant names from a sequence or a comma-separated string (``O0`` means ``fp32``).

    Names are case-sensitive, as ``initialize(opt_level=...)`` is: ``o1`` is refused with a hint, in the CLI
    (``--variants``) and in the API alike.
    """
    if isinstance(variants, str):
        variants = [v for v in variants.split(",") if v.strip()]
    names = []
    for raw in variants:
        name = "fp32" if str(raw).strip() == "O0" else str(raw).strip()
        if name not in VARIANTS and name not in EXTRA_VARIANTS:
            raise ConfigError(f"variant {raw!r}; allowed: {', '.join(VARIANTS + tuple(EXTRA_VARIANTS))} (O0 is "
                              "an alias of fp32; O2-remainder, bfloat16 only, runs only when named)"
                              + _case_hint(name))
        if name not in names:
            names.append(name)
    if not names:
        raise ConfigError(f"no variants given; allowed: {', '.join(VARIANTS + tuple(EXTRA_VARIANTS))}")
    return tuple(names)


def _case_hint(name):
    if name[:1] == "0" and "O" + name[1:] in VARIANTS + ("O0",):
        return f". The first character is the digit zero; opt levels start with the capital letter O ('O{name[1:]}')"
    for known in VARIANTS + tuple(EXTRA_VARIANTS) + ("O0",):
        if name.lower() == known.lower():
            return f". Variant names are case-sensitive, like initialize's opt_level: use {known!r}"
    return ""


_OP_LIST_VARIANT = re.compile(r"^O1 \[(.+)\]$")


def op_list_pairs(op_lists):
    """``(label, spec)`` per op list (a shipped name or a YAML file), each loaded once here so that a typo stops
    the experiment before any variant runs (``file:line``). A label is the name, or the file's name (its path as
    given where two files share a name); a spec is the name or the file's absolute path."""
    if op_lists is None:
        return ()
    items = [op_lists] if isinstance(op_lists, (str, os.PathLike)) else list(op_lists)
    if not items or not all(isinstance(i, (str, os.PathLike)) for i in items):
        raise ConfigError(f"op_lists={op_lists!r}; pass shipped names or YAML files, e.g. ['apex', 'fixed.yaml']")
    paths = [os.fspath(i) for i in items]
    files = [p for p in paths if _is_file_spec(p)]
    pairs = []
    for path in dict.fromkeys(paths):
        load_op_lists(path)
        if not _is_file_spec(path):
            pairs.append((path, path))
            continue
        name = os.path.basename(path)
        clash = sum(os.path.basename(f) == name for f in dict.fromkeys(files)) > 1
        pairs.append((path if clash else name, os.path.abspath(path)))
    return tuple(pairs)


def _is_file_spec(spec):
    return os.sep in spec or "/" in spec or spec.endswith((".yaml", ".yml"))


def expand_op_lists(variants, pairs):
    """``variants`` with O1 replaced by one ``O1 [label]`` per op list (in place of O1, in the lists' order)."""
    if not pairs:
        return tuple(variants)
    if "O1" not in variants:
        raise ConfigError(f"op lists ({', '.join(label for label, _ in pairs)}) apply to O1 only, and the variants "
                          f"are {', '.join(variants)}; add O1 to --variants (or drop --op-lists)")
    at = list(variants).index("O1")
    return tuple(variants[:at]) + tuple(f"O1 [{label}]" for label, _ in pairs) + tuple(variants[at + 1:])


class AmpVariant:
    """fp32 (O0), O1, O2 or O3 through amp_patch.initialize / scale_loss; ``O1 [label]``: O1 with the op list
    ``op_lists[label]``."""

    def __init__(self, variant, half_dtype, device, op_lists=()):
        listed = _OP_LIST_VARIANT.match(variant)
        if listed:
            self.kwargs = {"opt_level": "O1", "op_lists": dict(op_lists)[listed.group(1)]}
        else:
            self.kwargs = EXTRA_VARIANTS.get(variant, {"opt_level": "O0" if variant == "fp32" else variant})
        self.opt_level = self.kwargs["opt_level"]
        self.half_dtype = half_dtype

    def setup(self, model, optimizer):
        return amp_patch.initialize(model, optimizer, half_dtype=self.half_dtype, verbosity=0, **self.kwargs)

    def forward_context(self):
        return contextlib.nullcontext()

    def backward_and_step(self, loss, optimizer):
        with amp_patch.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    def loss_scale(self):
        return float(amp_patch.loss_scale())

    def last_skipped(self, optimizer):
        return bool(amp_patch.last_step_skipped(optimizer))

    def close(self):
        amp_patch.deinitialize()


class NativeVariant:
    """``torch.autocast`` around forward and loss, with ``torch.amp.GradScaler`` for float16 only."""

    def __init__(self, variant, half_dtype, device, op_lists=()):
        self.device_type = torch.device(device).type
        self.half_dtype = half_dtype
        self.scaler = None
        self._last_scale = None

    def setup(self, model, optimizer):
        if self.half_dtype is torch.float16:
            self.scaler = torch.amp.GradScaler(self.device_type)
            self._last_scale = self.scaler.get_scale()
        return model, optimizer

    def forward_context(self):
        return torch.autocast(self.device_type, dtype=self.half_dtype)

    def backward_and_step(self, loss, optimizer):
        if self.scaler is None:
            loss.backward()
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        self.scaler.update()

    def loss_scale(self):
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def last_skipped(self, optimizer):
        """GradScaler backs off exactly when it skipped the step: compare with the previous scale."""
        if self.scaler is None:
            return False
        scale = self.scaler.get_scale()
        skipped = scale < self._last_scale
        self._last_scale = scale
        return skipped

    def close(self):
        pass


def make_variant(variant, half_dtype, device, op_lists=()):
    return (NativeVariant if variant == "native" else AmpVariant)(variant, half_dtype, device, op_lists)


class CastCounter(TorchDispatchMode):
    """Counts ``aten._to_copy`` calls (every dtype cast) and which of them cast one of ``params``."""

    def __init__(self, params=()):
        super().__init__()
        self.casts = 0
        self.param_casts = []
        self._param_ids = {id(p) for p in params}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _TO_COPY:
            self.casts += 1
            if args and id(args[0]) in self._param_ids:
                self.param_casts.append(id(args[0]))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_syncs(device):
    """Yields a list that ends up holding one entry per host-device sync (CUDA only; None elsewhere)."""
    if torch.device(device).type != "cuda":
        yield None
        return
    found = []
    old_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(old_mode)
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())
