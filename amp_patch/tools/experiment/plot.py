"""``experiment.png``: one row per job, headed by the job's verdict, with only the panels that carry
information: step time per variant, each variant's memory growth during its run, the loss gap to fp32 per
step, and the loss scale where some variant's scale is dynamic (never with bfloat16, where it stays 1.0)."""
import logging
import math
import os
import textwrap

from .report import PNG_NAME, dynamic_scale_variants, label, loss_deviation, table_order

log = logging.getLogger("amp_patch")

# distinct dash patterns and markers, so that a line lying on another stays visible
_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "x"))


def panels(report):
    """The panels this job's row draws, in order."""
    names = ["time", "memory", "loss gap"]
    if dynamic_scale_variants(report):
        names.append("loss scale")
    return names


def write_png(reports, out_dir):
    """Write ``experiment.png`` in ``out_dir``; its path, or None (and a log line) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log.debug("matplotlib is not installed (pip install matplotlib); skipping the PNG")
        return None
    if not reports:
        return None
    fig = Figure(figsize=(16, sum(row_height(r) for r in reports)), layout="constrained")
    FigureCanvasAgg(fig)
    rows = fig.subfigures(len(reports), 1, squeeze=False, height_ratios=[row_height(r) for r in reports])[:, 0]
    for row, report in zip(rows, reports):
        draw_row(row, report)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PNG_NAME)
    fig.savefig(path, dpi=80)
    return path


def row_height(report):
    """Inches for one job's row: room for one horizontal bar per variant, the title and the legends below."""
    return max(4.2, 2.6 + 0.32 * len(report["variants"]))


def draw_row(subfig, report):
    """One job: its verdict as the row's title, then its panels; returns the axes by panel name."""
    verdict = (report.get("verdict") or {}).get("text", "")
    partial = " (interrupted: partial)" if report.get("partial") else ""
    subfig.suptitle(f"{report['job']}{partial}: " + "\n".join(textwrap.wrap(verdict, 150)), fontsize="medium")
    names = panels(report)
    axes = dict(zip(names, subfig.subplots(1, len(names), squeeze=False)[0]))
    draw = {"time": _plot_time, "memory": _plot_memory, "loss gap": _plot_deviation, "loss scale": _plot_scales}
    for name, ax in axes.items():
        draw[name](ax, report)
    return axes


def _timed(report):
    """The variants with a step time, in the table's order (fp32 first, then fastest first)."""
    return [(n, report["variants"][n]) for n in table_order(report["variants"])
            if report["variants"][n].get("median_step_ms") is not None]


def _plot_time(ax, report):
    """Horizontal bars, one per variant in the table's order from the top: the labels stay legible for any number
    of variants and any op-list name."""
    timed = _timed(report)
    medians = [v["median_step_ms"] for _, v in timed]
    spread = [[m - v["step_ms_min"] for m, (_, v) in zip(medians, timed)],
              [v["step_ms_max"] - m for m, (_, v) in zip(medians, timed)]]
    at = list(range(len(timed)))
    ax.barh(at, medians, xerr=spread, capsize=3, color="tab:blue")
    ax.set_yticks(at, [label(n) for n, _ in timed])
    ax.invert_yaxis()
    ax.set(title="step time: median, min-max of rounds\n(shorter is faster; table order)", xlabel="ms")


def memory_growth(v):
    """A variant's memory growth during its run (peak minus what its process held at the start), MiB."""
    peak, start = v.get("peak_memory_mib"), v.get("memory_at_start_mib")
    return None if peak is None or start is None else max(0.0, peak - start)


def _plot_memory(ax, report):
    """Two bars per variant: its memory growth during the run, and its state (weights, grads, optimizer)."""
    variants = report["variants"]
    names = [n for n in table_order(variants) if memory_growth(variants[n]) is not None or variants[n].get("state_mib")]
    at = range(len(names))
    grown = [memory_growth(variants[n]) or 0.0 for n in names]
    state = [variants[n].get("state_mib") or 0.0 for n in names]
    kind = next((v["memory_kind"] for v in variants.values() if v.get("memory_kind")), "memory")
    ax.barh([i - 0.2 for i in at], grown, height=0.4, color="tab:gray", label=f"growth ({kind} minus start)")
    ax.barh([i + 0.2 for i in at], state, height=0.4, color="tab:orange", label="state: weights+grads+optimizer")
    ax.set_yticks(list(at), [label(n) for n in names])
    ax.invert_yaxis()
    ax.set(title="memory: growth during the run, and training state", xlabel="MiB")
    if names:  # below the panel: never over a bar
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=1, frameon=False)


def _plot_deviation(ax, report):
    fp32 = report["variants"].get("fp32")
    others = [(n, v) for n, v in report["variants"].items() if n != "fp32"]
    for index, (name, v) in enumerate(others):
        deviation = [d if math.isfinite(d) else float("nan") for d in loss_deviation(v, fp32)]
        if not deviation:
            continue
        dash, marker = _STYLES[index % len(_STYLES)]
        every = max(1, len(deviation) // 8)
        ax.plot(range(len(deviation)), deviation, label=label(name), linestyle=dash, marker=marker,
                markevery=(index % every, every), markersize=max(4, 9 - index), fillstyle="none",
                markeredgewidth=1.5, linewidth=max(0.9, 2.2 - 0.3 * index), alpha=0.85, zorder=3 + index)
    ax.set(title="|loss - fp32 loss| per step", xlabel="step", ylabel="|Δloss|")
    if ax.lines:  # below the panel, in columns: never over a line
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)
    else:
        ax.text(0.5, 0.5, "no fp32 run to compare with", ha="center", transform=ax.transAxes)


def _plot_scales(ax, report):
    for index, name in enumerate(dynamic_scale_variants(report)):
        scales = report["variants"][name]["loss_scales"]
        dash, marker = _STYLES[index % len(_STYLES)]
        ax.plot(range(len(scales)), scales, label=label(name), linestyle=dash, marker=marker,
                markevery=max(1, len(scales) // 8), markersize=max(4, 9 - index), fillstyle="none", alpha=0.85)
    ax.set(title="loss scale (dynamic only)", xlabel="step", yscale="log")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)
