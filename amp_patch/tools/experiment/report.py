"""Turn variant results into a report: derived numbers, a markdown table, a JSON file, a PNG, a progress bar."""
import json
import logging
import math
import os
import re
import statistics
import sys
import time

import torch

from ..machine import describe, fp8_hardware, half_hardware
from .fp8_lists import uses_fp8
from .verdict import LOSS_TOLERANCE, MIN_ROUNDS, ranking, verdict

log = logging.getLogger("amp_patch")

JSON_NAME, PNG_NAME = "experiment.json", "experiment.png"
_USABLE = ("ok", "interrupted")  # an interrupted variant's finished rounds still compare


def summarize(job_name, config, results, isolated, loss_tolerance=LOSS_TOLERANCE):
    """The report of one job: its config and, per variant, the result plus ratios and loss deviation.

    A ratio is taken round by round (the variant's median step time in round i over the base's in round i, so a
    busy moment of the machine slows both sides of it); ``ratio_to_fp32`` is the median of those, with its
    spread (``ratio_to_fp32_min``/``_max``), the rounds it was taken over (``ratio_to_fp32_rounds``) and
    ``ratio_to_fp32_significant`` (False when the spread includes 1, or with fewer than ``MIN_ROUNDS`` rounds).
    ``verdict``: :func:`amp_patch.tools.experiment.verdict.verdict` of the variants.
    """
    fp32 = results.get("fp32")
    native = results.get("native")
    variants = {}
    for name, result in results.items():
        entry = dict(result)
        entry.update(_ratio(result, fp32, "fp32"))
        entry.update(_ratio(result, native, "native"))
        entry["max_loss_deviation_from_fp32"] = _max_deviation(result, fp32)
        variants[name] = entry
    return {"job": job_name, "steps": config.steps, "half_dtype": str(config.half_dtype).replace("torch.", ""),
            "device": config.device, "seed": config.seed, "isolated": isolated, "threads": _threads(results),
            "rounds": len(config.round_sizes()), "rounds_finished": _rounds_finished(results),
            "rounds_finished_fewest": _rounds_finished(results, fewest=True),
            "interleaved": isolated and len(results) > 1,
            "timeout_s": config.timeout_s, "torch_version": torch.__version__, "machine": machine_line(config),
            "variants": variants,
            "verdict": verdict(variants, loss_tolerance)}


def machine_line(config):
    """The machine, and whether the half dtype runs on hardware here (the reading of ``tools/machine.py``); the
    runs' thread count is the heading's, not this process's."""
    machine = re.sub(r", \d+ threads?$", "", describe(config.device))
    line = f"{machine}; {half_hardware(config.device, config.half_dtype).sentence()}"
    if uses_fp8(spec for _, spec in (getattr(config, "op_lists", None) or ())):
        line += f"; {fp8_hardware(config.device).sentence()}"
    return line


def _rounds_finished(results, fewest=False):
    """The most rounds any variant timed to the end (all of them, unless Ctrl-C stopped the experiment); with
    ``fewest``, the fewest of the variants that timed at least one (a row Ctrl-C stopped a round earlier)."""
    counts = [sum(1 for r in v["rounds"] if r.get("median_step_ms")) for v in results.values()]
    if fewest:
        return min((n for n in counts if n), default=0)
    return max(counts, default=0)


def _threads(results):
    counts = {r.get("threads") for r in results.values() if r.get("threads")}
    return counts.pop() if len(counts) == 1 else None


def _ratio(result, base, base_name):
    key = f"ratio_to_{base_name}"
    out = {key: None, f"{key}_min": None, f"{key}_max": None, f"{key}_significant": None, f"{key}_rounds": 0}
    if base is None or result.get("status") not in _USABLE or base.get("status") not in _USABLE:
        return out
    per_round = [r["median_step_ms"] / b["median_step_ms"] for r, b in zip(result["rounds"], base["rounds"])
                 if r["median_step_ms"] and b["median_step_ms"]]
    if not per_round:
        return out
    low, high = min(per_round), max(per_round)
    out.update({key: statistics.median(per_round), f"{key}_min": low, f"{key}_max": high,
                f"{key}_rounds": len(per_round),
                f"{key}_significant": result is base or (len(per_round) >= MIN_ROUNDS and not low <= 1.0 <= high)})
    return out


def _max_deviation(result, fp32):
    deviations = loss_deviation(result, fp32)
    return max(deviations) if deviations else None


def loss_deviation(result, fp32):
    """``|loss - fp32 loss|`` per step (inf where the variant's loss was not finite); [] without an fp32 run."""
    if fp32 is None or fp32["status"] not in _USABLE or not result["losses"]:
        return []
    return [abs(a - b) if isinstance(a, float) else math.inf for a, b in zip(result["losses"], fp32["losses"])]


def label(variant):
    """The row label: fp32 is opt level O0."""
    return "O0 (fp32)" if variant == "fp32" else variant


_COLUMNS = ("variant", "status", "median step ms (min-max)", "step time vs fp32 (<1 faster)",
            "vs native (<1 faster)", "peak mem MiB (+in run)", "state MiB", "weights a step left unchanged",
            "final loss", "max \\|Δloss\\| vs fp32", "skipped steps", "final loss scale", "casts/iter",
            "syncs/step")


def markdown(report):
    """A markdown section for one job: a heading, the table, notes on the columns and every variant's error."""
    lines = [_heading(report), ""] + ([f"Machine: {report['machine']}.", ""] if report.get("machine") else [])
    lines += ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for name in table_order(report["variants"]):
        v = report["variants"][name]
        cells = [label(name), v["status"], _spread(v["median_step_ms"], v["step_ms_min"], v["step_ms_max"]),
                 _times(v, "fp32"), _times(v, "native"), _memory(v), _num(v.get("state_mib"), 2),
                 _share(v.get("unchanged_by_update")),
                 _final_loss(v, report["variants"]),
                 _num(v["max_loss_deviation_from_fp32"], 4), str(v["skipped_steps"]),
                 _num(v["final_loss_scale"], 0), _num(v["casts_per_iteration"], 0), _num(v["syncs_per_step"], 0)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", _notes(report)]
    for name, v in report["variants"].items():
        if v["error"]:
            lines.append(f"- **{label(name)}** {v['status']}: {v['error']}")
    if report.get("verdict"):
        lines += ["", f"**{report['verdict']['text']}**"]
    return "\n".join(lines)


def table_order(variants):
    """fp32 (the reference) first, then the others in the verdict's :func:`ranking` (fastest first)."""
    return sorted(ranking(variants), key=lambda name: name != "fp32")


def _heading(report):
    n = report["threads"]
    threads = f", {n} thread{'' if n == 1 else 's'}" if n else ""
    return (f"### {report['job']}: {report['steps']} steps, {report['half_dtype']}, {report['device']}{threads}, "
            f"seed {report['seed']}{'' if report['isolated'] else ', in-process (not isolated)'}"
            f"{' (interrupted: partial results)' if report.get('partial') else ''}")


def _notes(report):
    kinds = sorted({v["memory_kind"] for v in report["variants"].values() if v["memory_kind"]})
    return (f"{_step_times_note(report)}; a ratio is the variant's step time over fp32's (or "
            "native's): below 1.00x is faster. It is taken round by round, and *n.s.* marks one whose min-max "
            f"includes 1.00x or that has fewer than {MIN_ROUNDS} rounds (not significant). Rows after fp32 go "
            f"fastest first by median step time, in the verdict's order. Peak memory: {'; '.join(kinds) or 'n/a'} "
            "(+ its growth during the run). State MiB: weights + grads + optimizer state (masters kept beside the "
            "weights included), from the tensors' storages, each counted once. Weights a step left unchanged: of "
            "the weights with a nonzero gradient, the share one more step after the last round left bitwise as they "
            "were (lost updates: half weights under O3 drop updates below their resolution). Casts/iter: "
            "aten._to_copy calls in one forward+backward+step.")


def _step_times_note(report):
    """How many rounds the step times are medians over, and why any planned ones are missing: Ctrl-C only when
    the run was interrupted; else the variants that stopped early, each with its status."""
    rounds = report.get("rounds_finished", report["rounds"])
    fewest = report.get("rounds_finished_fewest") or rounds
    interrupted = report.get("partial") or any(v["status"] == "interrupted" for v in report["variants"].values())
    if not rounds:
        return ("Step times: none, Ctrl-C stopped the experiment before any variant timed a round" if interrupted
                else "Step times: none, no variant timed a round (each stopped before its first timed step)")
    planned = ""
    if fewest < report["rounds"]:
        short = [f"{label(n)} {v['status']}" for n, v in report["variants"].items() if v["status"] != "ok"
                 and sum(1 for r in v["rounds"] if r.get("median_step_ms")) < report["rounds"]]
        why = "Ctrl-C stopped the rest" if interrupted else ", ".join(short) or "a variant stopped early"
        planned = f" (of {report['rounds']} planned: {why})"
    how = ("each round runs every variant in turn, each in its own process" if report["interleaved"] else
           "the rounds of one variant back to back")
    return (f"Step times: median over {_span(fewest, rounds)} round{'s' if rounds != 1 else ''}{planned} ({how}) "
            "of each round's median step, with the rounds' min-max")


def _span(low, high):
    return str(high) if low >= high else f"{low}-{high}"


def _num(value, digits):
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.{digits}f}" if digits or abs(value) < 1e7 else f"{value:.3g}"


def _final_loss(v, variants):
    """The final loss, with its step count when the variants stopped after different numbers of steps (Ctrl-C, a
    divergence): the losses of different steps are not comparable."""
    runs = {x.get("steps_run") for x in variants.values() if x.get("losses")}
    text = _num(v["final_loss"], 4)
    return text if len(runs) <= 1 or not v.get("losses") else f"{text} (after {v['steps_run']} steps)"


def _share(value):
    return "-" if value is None else f"{value:.1%}"


def _memory(v):
    """``peak (+growth over the run's start)``."""
    peak, start = v["peak_memory_mib"], v.get("memory_at_start_mib")
    if peak is None or start is None:
        return _num(peak, 0)
    return f"{peak:.0f} (+{max(0.0, peak - start):.0f})"


def _spread(value, low, high):
    if value is None:
        return "-"
    return f"{value:.3f} ({low:.3f}-{high:.3f})" if low != high else f"{value:.3f}"


def _times(v, base):
    ratio = v[f"ratio_to_{base}"]
    if ratio is None:
        return "-"
    low, high = v[f"ratio_to_{base}_min"], v[f"ratio_to_{base}_max"]
    text = f"{ratio:.2f}x" + (f" ({low:.2f}-{high:.2f})" if low != high else "")
    return text if v[f"ratio_to_{base}_significant"] else text + " n.s."


def write_json(reports, out_dir, partial=False):
    """``experiment.json``; ``partial``: Ctrl-C stopped the experiment (some jobs or rounds are missing)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, JSON_NAME)
    with open(path, "w", encoding="utf-8") as f:
        data = {"partial": bool(partial or any(r.get("partial") for r in reports)),
                "jobs": {r["job"]: r for r in reports}}
        json.dump(_jsonable(data), f, indent=1, allow_nan=False)
    return path


def _jsonable(value):
    """Non-finite floats as strings ("inf", "nan"), so the file is strict JSON."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def dynamic_scale_variants(report):
    """The variants whose loss scale changed or is not 1.0 (a static 1.0 scale is not drawn)."""
    return [n for n, v in report["variants"].items() if v["loss_scales"] and set(v["loss_scales"]) != {1.0}]


class Progress:
    """Progress on stderr: :meth:`announce` writes one line as the experiment starts; then, on a terminal only
    (stdout and stderr both), a bar with the elapsed time and an ETA: ``[#####-----]  50% mlp O1 20/40  0:12
    elapsed, ETA 0:12``. Quiet when the output goes to a file or a pipe. Runs may interleave: each run (label)
    counts its own steps, the bar shows their sum.
    """

    def __init__(self, total_runs, steps, stream=None, enabled=True, width=28, tty=None, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.total = max(1, total_runs * steps)
        self.steps = steps
        self.width = width
        self.done = {}
        self.label = ""
        self.clock = clock
        self.started = clock()
        self._first = None  # (time, steps done) at the first step reported: the ETA's rate starts there
        self.tty = enabled and (_both_terminals(self.stream) if tty is None else tty)

    def announce(self, text):
        """One line, terminal or not (unless progress is off): the command has started."""
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()
            self.started = self.clock()

    def start(self, label):
        self.label = label
        self._render()

    def step(self, done_in_run, label=None):
        self.done[label or self.label] = done_in_run
        if self._first is None:
            self._first = (self.clock(), sum(self.done.values()))
        self._render()

    def end_run(self, status, label=None):
        self.done[label or self.label] = self.steps
        self._render()

    def note(self, text):
        """(Rounds advance silently: the bar shows them on a terminal.)"""

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def fraction(self):
        return min(1.0, sum(self.done.values()) / self.total)

    def times(self):
        """``elapsed`` and ``eta`` in seconds. The ETA extrapolates the rate since the first step reported, not
        since the start: starting the variant processes and building the models costs seconds before any step,
        and counted into the rate it made the first ETA hours long. None until a second step is reported."""
        now = self.clock()
        elapsed = max(0.0, now - self.started)
        done = sum(self.done.values())
        if self._first is None or done <= self._first[1]:
            return elapsed, None
        rate = (now - self._first[0]) / (done - self._first[1])
        return elapsed, rate * max(0, self.total - done)

    def line(self):
        frac = self.fraction()
        filled = int(round(frac * self.width))
        elapsed, eta = self.times()
        return (f"[{'#' * filled}{'-' * (self.width - filled)}] {frac * 100:3.0f}% {self.label} "
                f"{self.done.get(self.label, 0)}/{self.steps}  {_clock(elapsed)} elapsed, ETA "
                f"{'?' if eta is None else _clock(eta)}")

    def _render(self):
        if self.tty:
            self.stream.write(f"\r{self.line()}\x1b[K")
            self.stream.flush()


def _clock(seconds):
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}:" if hours else "") + f"{rest // 60:{'02' if hours else ''}d}:{rest % 60:02d}"


def _both_terminals(stream):
    try:
        return stream.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False
