"""Turn variant results into a report: derived numbers, a markdown table, a JSON file, a PNG, a progress bar."""
import json
import logging
import math
import os
import sys

import torch

log = logging.getLogger("amp_patch")

JSON_NAME, PNG_NAME = "experiment.json", "experiment.png"


def summarize(job_name, config, results, isolated):
    """The report of one job: its config and, per variant, the result plus ratios and loss deviation."""
    fp32 = results.get("fp32")
    native = results.get("native")
    variants = {}
    for name, result in results.items():
        entry = dict(result)
        entry["ratio_to_fp32"] = _ratio(result, fp32)
        entry["ratio_to_native"] = _ratio(result, native)
        entry["max_loss_deviation_from_fp32"] = _max_deviation(result, fp32)
        variants[name] = entry
    return {"job": job_name, "steps": config.steps, "half_dtype": str(config.half_dtype).replace("torch.", ""),
            "device": config.device, "seed": config.seed, "isolated": isolated, "threads": _threads(results),
            "torch_version": torch.__version__, "variants": variants}


def _threads(results):
    counts = {r.get("threads") for r in results.values() if r.get("threads")}
    return counts.pop() if len(counts) == 1 else None


def _ratio(result, base):
    if base is None or not result.get("median_step_ms") or not base.get("median_step_ms"):
        return None
    return result["median_step_ms"] / base["median_step_ms"]


def _max_deviation(result, fp32):
    if fp32 is None or fp32["status"] != "ok" or not result["losses"]:
        return None
    pairs = list(zip(result["losses"], fp32["losses"]))
    if any(not isinstance(a, float) for a, _ in pairs):
        return math.inf
    return max(abs(a - b) for a, b in pairs)


_COLUMNS = ("variant", "status", "median step ms", "vs fp32", "vs native", "peak mem MiB (+in run)", "final loss",
            "max |Δloss| vs fp32", "skipped steps", "final loss scale", "casts/iter", "syncs/step")


def markdown(report):
    """A markdown section for one job: a heading, the table, the memory kind and every variant's error."""
    n = report["threads"]
    threads = f", {n} thread{'' if n == 1 else 's'}" if n else ""
    lines = [f"### {report['job']}: {report['steps']} steps, {report['half_dtype']}, {report['device']}{threads}, "
             f"seed {report['seed']}{'' if report['isolated'] else ', in-process (not isolated)'}", "",
             "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for name, v in report["variants"].items():
        cells = [name, v["status"], _num(v["median_step_ms"], 3), _times(v["ratio_to_fp32"]),
                 _times(v["ratio_to_native"]), _memory(v), _num(v["final_loss"], 4),
                 _num(v["max_loss_deviation_from_fp32"], 4), str(v["skipped_steps"]),
                 _num(v["final_loss_scale"], 0), _num(v["casts_per_iteration"], 0), str(v["syncs_per_step"])]
        lines.append("| " + " | ".join(cells) + " |")
    kinds = sorted({v["memory_kind"] for v in report["variants"].values() if v["memory_kind"]})
    lines.append("")
    lines.append(f"Peak memory: {'; '.join(kinds) or 'n/a'} (+ its growth during the run). Casts/iter: "
                 "aten._to_copy calls in one "
                 "forward+backward+step. Step times come from separate runs; for ratios measured interleaved "
                 "in one process see benchmarks/bench_step_time.py.")
    for name, v in report["variants"].items():
        if v["error"]:
            lines.append(f"- **{name}** {v['status']}: {v['error']}")
    return "\n".join(lines)


def _num(value, digits):
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.{digits}f}" if digits or abs(value) < 1e7 else f"{value:.3g}"


def _memory(v):
    """``peak (+growth over the run's start)``."""
    peak, start = v["peak_memory_mib"], v.get("memory_at_start_mib")
    if peak is None or start is None:
        return _num(peak, 0)
    return f"{peak:.0f} (+{max(0.0, peak - start):.0f})"


def _times(value):
    return "-" if value is None else f"{value:.2f}x"


def write_json(reports, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, JSON_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable({"jobs": {r["job"]: r for r in reports}}), f, indent=1, allow_nan=False)
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


def write_png(reports, out_dir):
    """Loss and loss-scale curves per variant, one row per job; None (and a log line) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.debug("matplotlib is not installed (pip install amp_patch[plot]); skipping the PNG")
        return None
    fig = Figure(figsize=(11, 3.2 * len(reports)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(reports), 2, squeeze=False)
    for row, report in zip(axes, reports):
        for name, v in report["variants"].items():
            losses = [x if isinstance(x, float) else float("nan") for x in v["losses"]]
            row[0].plot(range(len(losses)), losses, label=f"{name} ({v['status']})")
            row[1].plot(range(len(v["loss_scales"])), v["loss_scales"], label=name)
        row[0].set(title=f"{report['job']}: loss", xlabel="step", ylabel="loss")
        row[1].set(title=f"{report['job']}: loss scale", xlabel="step", ylabel="loss scale", yscale="log")
        row[0].legend(fontsize="small")
        row[1].legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PNG_NAME)
    fig.savefig(path, dpi=90)
    return path


class Progress:
    """A text progress bar on stderr: ``[#####-----]  50% mlp O1 20/40``; one line per run when not a TTY.

    Runs may interleave: each run (label) counts its own steps, the bar shows their sum.
    """

    def __init__(self, total_runs, steps, stream=None, enabled=True, width=28):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.total = max(1, total_runs * steps)
        self.steps = steps
        self.width = width
        self.done = {}
        self.label = ""
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()

    def start(self, label):
        self.label = label
        self._render()

    def step(self, done_in_run, label=None):
        self.done[label or self.label] = done_in_run
        if self.tty:
            self._render()

    def end_run(self, status, label=None):
        label = label or self.label
        self.done[label] = self.steps
        if self.enabled and not self.tty:
            self.stream.write(f"{self._bar()} {label}: {status}\n")
            self.stream.flush()
        elif self.tty:
            self._render()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _bar(self):
        frac = min(1.0, sum(self.done.values()) / self.total)
        filled = int(round(frac * self.width))
        return f"[{'#' * filled}{'-' * (self.width - filled)}] {frac * 100:3.0f}%"

    def _render(self):
        if self.tty:
            self.stream.write(f"\r{self._bar()} {self.label} {self.done.get(self.label, 0)}/{self.steps}\x1b[K")
            self.stream.flush()
