"""``doctor(job, ...)``: the steps, each a named function; the result is a :class:`DoctorReport`."""
import contextlib
import dataclasses
import math
import os
import time

import torch

from ...config.dtypes import parse_half_dtype
from ...errors import ConfigError, UsageError
from ...session import state as _state
from ..cli import opt_level_hint
from ..experiment.models import as_job, load_job
from .fix import Fix, base_for_file, op_list_spec, search, yaml_text
from .locate import replay
from .training import train

HEALTHY, FIXED, NOT_FIXABLE, UNVERIFIED = "healthy", "fixed", "not_fixable", "unverified"


@dataclasses.dataclass
class DoctorReport:
    """What the doctor found. ``exit_code``: 0 healthy or fixed and verified, 1 otherwise."""

    job: str
    opt_level: str
    half_dtype: str
    steps: int
    status: str
    summary: str
    before: dict
    culprits: list = dataclasses.field(default_factory=list)
    fixes: list = dataclasses.field(default_factory=list)
    after: dict = None
    fp32_final_loss: float = None
    op_list: str = None  # the YAML text of the fix
    written: str = None  # where it was written
    measure: str = None  # the experiment command that measures the written list against the one it extends
    intended: list = dataclasses.field(default_factory=list)  # ops whose inf/NaN float32 holds too (masks)
    log: list = dataclasses.field(default_factory=list)
    seconds: dict = dataclasses.field(default_factory=dict)

    @property
    def exit_code(self):
        return 0 if self.status in (HEALTHY, FIXED) else 1

    def as_dict(self):
        out = dataclasses.asdict(self)
        out["exit_code"] = self.exit_code
        return out

    def to_markdown(self):
        from .report import markdown
        return markdown(self)


def doctor(job, *, opt_level="O1", half_dtype=torch.float16, steps=40, op_lists=None, out=None):
    """Diagnose ``job`` (a Job, a job dict/object or a ``module:function`` string); see :mod:`amp_patch.tools.doctor`.

    ``op_lists``: the list the job uses (a shipped name or a path; default ``"apex"``); the written list
    ``extends`` it. ``out``: where to write the fix (only when one is found and verified).
    """
    half_dtype, base = _check_args(opt_level, half_dtype, steps, op_lists)
    job, name = _load(job)
    report = DoctorReport(name, opt_level, str(half_dtype).replace("torch.", ""), steps, HEALTHY, "", {})
    timer = _Timer(report.seconds)
    with timer("train"):
        run = train(job, opt_level=opt_level, half_dtype=half_dtype, steps=steps, op_lists=base)
    report.before = _run_summary(run)
    if run.healthy:
        return _healthy(report, run)
    if run.failure is None:
        return _finish(report, NOT_FIXABLE, "the loss is not finite at the end, but no step failed in a way "
                       "the doctor can replay")
    with timer("replay"):
        fixes = _diagnose(report, job, run, half_dtype, base)
    if fixes is None:
        return report
    with timer("verify"):
        _verify(report, job, half_dtype, steps, base, fixes)
    if report.status == FIXED and out is not None:
        _write(report, base, out)
    return report


def _load(job):
    if isinstance(job, str):
        loaded = load_job(job)
        return loaded, job
    loaded = as_job(job)
    return loaded, loaded.name


def _check_args(opt_level, half_dtype, steps, op_lists):
    if _state.current() is not None or _state.active_engine() is not None:
        raise UsageError("amp_patch.doctor() trains the job in its own sessions; call amp_patch.deinitialize() "
                         "(or close the autocast() region) first")
    if opt_level != "O1" and opt_level_hint(opt_level):  # a near miss: "01", "o1"
        raise ConfigError(f"opt_level={opt_level!r}; allowed: 'O1'{opt_level_hint(opt_level)}")
    if opt_level != "O1":
        raise ConfigError(
            f"opt_level={opt_level!r}; allowed: 'O1'. The doctor proposes op-list changes, and op lists act only "
            "through O1's per-op casting (under O2/O3 the model's weights and activations are themselves half, so "
            "no op list moves an op to float32). Run the doctor with opt_level='O1' to find the op, then train at "
            "O1 with the list it writes, or at O2/O3 keep the culprit's module type in float32 with "
            "initialize(..., keep_fp32_modules=(TheModule,))")
    half_dtype = parse_half_dtype(half_dtype)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ConfigError(f"steps={steps!r}; pass an integer >= 2")
    if op_lists is None:
        return half_dtype, "apex"
    if not isinstance(op_lists, (str, os.PathLike)):
        raise ConfigError(f"op_lists={op_lists!r}; the doctor needs a shipped list name or a path (the list it "
                          "writes extends it)")
    spec = os.fspath(op_lists)
    is_path = os.sep in spec or "/" in spec or spec.endswith((".yaml", ".yml"))
    return half_dtype, os.path.abspath(spec) if is_path else spec


def _run_summary(run):
    return {"steps": len(run.losses), "skipped": len(run.skips), "warmup_skips": len(run.warmup_skips),
            "other_skips": len(run.bad_skips), "final_loss": _num(run.final_loss), "final_scale": run.final_scale,
            "first_failure": ({"step": run.failure.step, "cause": run.failure.cause} if run.failure else None),
            "causes": sorted({s["cause"] for s in run.skips})}


def _num(value):
    return value if value is None or math.isfinite(value) else str(value)


def _healthy(report, run):
    warmup = len(run.warmup_skips)
    later = sum(s["kind"] == "backoff" for s in run.skips)
    recovered = f" ({later} of them later backoffs the scaler recovered from at the next step)" if later else ""
    why = (f"; {warmup} warm-up skip(s){recovered}: the dynamic loss scale backed off from {run.skips[0]['scale']} "
           "until the gradients fit, as designed" if warmup else "")
    return _finish(report, HEALTHY, f"no op-list change needed: no skipped step after warm-up and a finite "
                   f"final loss{why}")


def _finish(report, status, summary):
    report.status, report.summary = status, summary
    return report


def _diagnose(report, job, run, half_dtype, base):
    """Float32 replay (is it genuine?), then the candidate search. The fixes, or None when the report is final."""
    failure = run.failure
    precise = replay(job, failure.state, failure.batch, half_dtype=half_dtype, op_lists=None, precise=True)
    if precise.genuine:
        report.culprits = [c.as_dict() for c in precise.culprits[:1]]
        where = (f"model input(s) {precise.bad_inputs} of the batch at step {failure.step} already hold inf/NaN"
                 if precise.bad_inputs else _first_culprit_text(precise.culprits, "in float32 too"))
        _finish(report, NOT_FIXABLE, f"not fixable by op lists: the failure is a genuine non-finite value, not "
                f"half precision: {where}. Check the data, or guard the op (e.g. clamp before log).")
        return None
    _note_intended(report, precise)
    failure.intended = precise.intended
    fixes, found, first, last = search(job, failure, half_dtype=half_dtype, base=base, log=report.log)
    if first is not None and first.clean:
        _finish(report, NOT_FIXABLE, f"not fixable by op lists: the batch of step {failure.step} runs cleanly under "
                "O1 at loss scale 1, so its overflow came from the loss scale (gradients times the scale beyond the "
                "half range), not from an op's range; the dynamic scaler backs off from it. If skips persist, "
                "lower max_loss_scale or raise growth_interval.")
        return None
    report.culprits = [c.as_dict() for c in found]
    report.fixes = [f.as_row() for f in fixes]
    if last is None or not last.clean:
        _finish(report, NOT_FIXABLE, "not fixable by op lists: float32 runs the failing batch cleanly, but no "
                f"op-list change the doctor tried removed the bad values ({_first_culprit_text(found, '')})")
        return None
    return fixes


def _note_intended(report, precise):
    """The float32 replay's own non-finite values (masks): said in the report, then not counted as failures."""
    ops = precise.intended_ops()
    if ops:
        report.intended = ops
        report.log.append(f"float32 replay: loss {precise.loss:.4g}, gradients finite; the non-finite values of "
                          f"{', '.join(ops[:4])}{' and more' if len(ops) > 4 else ''} are the model's own (masks) "
                          "and do not count as failures")


def _first_culprit_text(culprits, suffix):
    if not culprits:
        return "no single op could be named"
    c = culprits[0]
    return f"first bad value from {c.qualname} in {c.module or 'the model'!r} ({c.where}) {suffix}".strip()


def _verify(report, job, half_dtype, steps, base, fixes):
    fp32 = train(job, opt_level="O0", half_dtype=half_dtype, steps=steps)
    fixed = train(job, opt_level="O1", half_dtype=half_dtype, steps=steps, op_lists=op_list_spec(base, fixes))
    report.after = _run_summary(fixed)
    report.fp32_final_loss = _num(fp32.final_loss)
    report.op_list = yaml_text(base, fixes, _header(report))
    if fixed.healthy:
        rel = _relative(fixed.final_loss, fp32.final_loss)
        _finish(report, FIXED, f"op-list change needed: {', '.join(_describe(f) for f in fixes)}; retrained "
                f"with it: {len(fixed.bad_skips)} skipped step(s) after warm-up (before: "
                f"{report.before['other_skips']}), final loss {fixed.final_loss:.4g} vs float32 "
                f"{fp32.final_loss:.4g} ({rel})")
    else:
        _finish(report, UNVERIFIED, "the change cleans the failing batch but retraining with it still fails "
                f"({fixed.bad_skips[0]['cause'] if fixed.bad_skips else 'non-finite final loss'}); not written")


def _describe(fix):
    where = f"in {fix.scope!r}" if fix.scope else "everywhere"
    return f"{fix.target}.{fix.name} in {'float32' if fix.category == 'float' else fix.category} {where}"


def _relative(value, reference):
    if reference is None or not math.isfinite(reference) or reference == 0:
        return "no float32 reference"
    return f"{(value - reference) / abs(reference):+.1%}"


def _header(report):
    return [f"written by amp-patch doctor for {report.job} ({report.opt_level}, {report.half_dtype}, "
            f"{report.steps} steps)", "validate with: amp-patch validate THIS_FILE"]


def _write(report, base, out):
    text = yaml_text(base_for_file(base, out), [_fix_from(f) for f in report.fixes], _header(report))
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    report.op_list, report.written = text, os.fspath(out)
    job = report.job if ":" in report.job else "MODULE:FUNCTION"
    report.measure = (f"amp-patch experiment --job {job} --half-dtype {report.half_dtype} --variants O0,O1 "
                      f"--op-lists {base} {report.written}")


def _fix_from(row):
    return Fix(**row)


class _Timer:
    """``with timer("name"):`` adds the body's wall time in seconds to ``seconds["name"]``."""

    def __init__(self, seconds):
        self.seconds = seconds

    @contextlib.contextmanager
    def __call__(self, name):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - start, 3)
