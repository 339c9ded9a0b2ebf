"""Turn variant results into a report: derived numbers, a markdown table, a JSON file, a PNG, a progress bar."""
import json
import logging
import math
import os
import statistics
import sys

import torch

log = logging.getLogger("amp_patch")

JSON_NAME, PNG_NAME = "experiment.json", "experiment.png"


def summarize(job_name, config, results, isolated):
    """The report of one job: its config and, per variant, the result plus ratios and loss deviation.

    A ratio is taken round by round (the variant's median step time in round i over the base's in round i, so a
    busy moment of the machine slows both sides of it); ``ratio_to_fp32`` is the median of those, with its
    spread (``ratio_to_fp32_min``/``_max``) and ``ratio_to_fp32_significant`` (False when the spread includes 1).
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
            "rounds": len(config.round_sizes()), "interleaved": isolated and len(results) > 1,
            "timeout_s": config.timeout_s, "torch_version": torch.__version__, "variants": variants}


def _threads(results):
    counts = {r.get("threads") for r in results.values() if r.get("threads")}
    return counts.pop() if len(counts) == 1 else None


def _ratio(result, base, base_name):
    key = f"ratio_to_{base_name}"
    out = {key: None, f"{key}_min": None, f"{key}_max": None, f"{key}_significant": None}
    if base is None or result.get("status") != "ok" or base.get("status") != "ok":
        return out
    per_round = [r["median_step_ms"] / b["median_step_ms"] for r, b in zip(result["rounds"], base["rounds"])
                 if r["median_step_ms"] and b["median_step_ms"]]
    if not per_round:
        return out
    low, high = min(per_round), max(per_round)
    out.update({key: statistics.median(per_round), f"{key}_min": low, f"{key}_max": high,
                f"{key}_significant": result is base or not low <= 1.0 <= high})
    return out


def _max_deviation(result, fp32):
    deviations = loss_deviation(result, fp32)
    return max(deviations) if deviations else None


def loss_deviation(result, fp32):
    """``|loss - fp32 loss|`` per step (inf where the variant's loss was not finite); [] without an fp32 run."""
    if fp32 is None or fp32["status"] != "ok" or not result["losses"]:
        return []
    return [abs(a - b) if isinstance(a, float) else math.inf for a, b in zip(result["losses"], fp32["losses"])]


def label(variant):
    """The row label: fp32 is opt level O0."""
    return "O0 (fp32)" if variant == "fp32" else variant


_COLUMNS = ("variant", "status", "median step ms (min-max)", "vs fp32", "vs native", "peak mem MiB (+in run)",
            "final loss", "max \\|Δloss\\| vs fp32", "skipped steps", "final loss scale", "casts/iter",
            "syncs/step")
_DTYPE_WHY = {
    "bfloat16": "the default here, as bf16 needs no loss scaling and is CPU autocast's dtype; initialize() "
                "defaults to float16, as Apex did, which --half-dtype float16 compares",
    "float16": "initialize()'s default, as Apex's; dynamic loss scaling on for O1/O2 and native (GradScaler)",
}


def markdown(report):
    """A markdown section for one job: a heading, the table, notes on the columns and every variant's error."""
    lines = [_heading(report), "", f"Half dtype {report['half_dtype']}: {_DTYPE_WHY[report['half_dtype']]}.", "",
             "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for name, v in report["variants"].items():
        cells = [label(name), v["status"], _spread(v["median_step_ms"], v["step_ms_min"], v["step_ms_max"]),
                 _times(v, "fp32"), _times(v, "native"), _memory(v), _num(v["final_loss"], 4),
                 _num(v["max_loss_deviation_from_fp32"], 4), str(v["skipped_steps"]),
                 _num(v["final_loss_scale"], 0), _num(v["casts_per_iteration"], 0), str(v["syncs_per_step"])]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", _notes(report)]
    for name, v in report["variants"].items():
        if v["error"]:
            lines.append(f"- **{label(name)}** {v['status']}: {v['error']}")
    return "\n".join(lines)


def _heading(report):
    n = report["threads"]
    threads = f", {n} thread{'' if n == 1 else 's'}" if n else ""
    return (f"### {report['job']}: {report['steps']} steps, {report['half_dtype']}, {report['device']}{threads}, "
            f"seed {report['seed']}{'' if report['isolated'] else ', in-process (not isolated)'}")


def _notes(report):
    kinds = sorted({v["memory_kind"] for v in report["variants"].values() if v["memory_kind"]})
    rounds = report["rounds"]
    how = ("each round runs every variant in turn, each in its own process" if report["interleaved"] else
           "the rounds of one variant back to back")
    return (f"Step times: median over {rounds} round{'s' if rounds != 1 else ''} ({how}) of each round's median "
            "step, with the rounds' min-max; a ratio is taken round by round, and *n.s.* marks one whose min-max "
            f"includes 1.00x (not significant). Peak memory: {'; '.join(kinds) or 'n/a'} (+ its growth during the "
            "run). Casts/iter: aten._to_copy calls in one forward+backward+step.")


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
    """What a user decides on, one row per job: step time and peak memory per variant (bars: the median over the
    rounds with their min-max), the loss deviation from fp32 per step, and the loss scale of the variants
    whose scale is dynamic. None (and a log line) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.debug("matplotlib is not installed (pip install matplotlib); skipping the PNG")
        return None
    fig = Figure(figsize=(16, 3.4 * len(reports)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(reports), 4, squeeze=False)
    for row, report in zip(axes, reports):
        _plot_bars(row[0], row[1], report)
        _plot_deviation(row[2], report)
        _plot_scales(row[3], report)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PNG_NAME)
    fig.savefig(path, dpi=80)
    return path


def _plot_bars(time_ax, mem_ax, report):
    names = [n for n, v in report["variants"].items() if v["median_step_ms"] is not None]
    vs = [report["variants"][n] for n in names]
    labels = [label(n) for n in names]
    medians = [v["median_step_ms"] for v in vs]
    spread = [[m - v["step_ms_min"] for m, v in zip(medians, vs)], [v["step_ms_max"] - m for m, v in zip(medians, vs)]]
    time_ax.bar(labels, medians, yerr=spread, capsize=4, color="tab:blue")
    time_ax.set(title=f"{report['job']}: step time\nmedian, min-max of rounds", ylabel="ms")
    _plot_memory(mem_ax, report, labels, vs)


def _plot_memory(ax, report, labels, vs):
    """Each round's peak: median with min-max bars; the whole run's peak (no spread) where rounds have none."""
    per_round = all(v.get("peak_memory_median_mib") is not None for v in vs)
    if per_round:
        mems = [v["peak_memory_median_mib"] for v in vs]
        spread = [[m - v["peak_memory_min_mib"] for m, v in zip(mems, vs)],
                  [v["peak_memory_max_mib"] - m for m, v in zip(mems, vs)]]
        ax.bar(labels, mems, yerr=spread, capsize=4, color="tab:gray")
    else:
        ax.bar(labels, [v["peak_memory_mib"] or 0.0 for v in vs], color="tab:gray")
    what = f"{vs[0]['memory_kind']}: " if vs else ""
    how = "median, min-max of rounds" if per_round else "whole run (no per-round peak in process)"
    ax.set(title=f"{report['job']}: peak memory\n{what}{how}", ylabel="MiB")


def _plot_deviation(ax, report):
    fp32 = report["variants"].get("fp32")
    for name, v in report["variants"].items():
        if name == "fp32":
            continue
        deviation = [d if math.isfinite(d) else float("nan") for d in loss_deviation(v, fp32)]
        if deviation:
            ax.plot(range(len(deviation)), deviation, label=label(name))
    ax.set(title=f"{report['job']}: |loss - fp32 loss|", xlabel="step", ylabel="|Δloss|")
    if ax.lines:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no fp32 run to compare with", ha="center", transform=ax.transAxes)


def dynamic_scale_variants(report):
    """The variants whose loss scale changed or is not 1.0 (a static 1.0 scale is not drawn)."""
    return [n for n, v in report["variants"].items() if v["loss_scales"] and set(v["loss_scales"]) != {1.0}]


def _plot_scales(ax, report):
    for name in dynamic_scale_variants(report):
        scales = report["variants"][name]["loss_scales"]
        ax.plot(range(len(scales)), scales, label=label(name))
    ax.set(title=f"{report['job']}: loss scale (dynamic only)", xlabel="step")
    if ax.lines:
        ax.set(yscale="log")
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "static loss scale 1.0 in every variant", ha="center", transform=ax.transAxes)


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

    def note(self, text):
        """One line between runs when stderr is not a terminal (a log file shows the interleaved rounds advance)."""
        if self.enabled and not self.tty:
            self.stream.write(f"{self._bar()} {text}\n")
            self.stream.flush()

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
