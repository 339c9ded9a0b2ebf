"""The doctor's markdown report."""


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _run_line(label, run):
    if not run:
        return []
    first = run["first_failure"]
    tail = f"; first failure at step {first['step']}: {first['cause']}" if first else ""
    return [f"- {label}: {run['steps']} steps, {run['skipped']} skipped ({run['warmup_skips']} warm-up, "
            f"{run['other_skips']} other), final loss {_fmt(run['final_loss'])}, final loss scale "
            f"{_fmt(run['final_scale'])}{tail}"]


def _culprit_table(culprits, half_dtype):
    if not culprits:
        return []
    lines = ["", "## Culprits (first bad value, in execution order)", "",
             f"| module | op | category | why it ran in {half_dtype} | bad | input dtypes | max abs value in float32 |",
             "|---|---|---|---|---|---|---|"]
    for c in culprits:
        lines.append(f"| {c['module'] or '(model)'} | {c['op']} | {c['category']} | {c['source']} | {c['where']} | "
                     f"{', '.join(c['input_dtypes'])} | {_fmt(c['max_abs_float32'])} |")
    return lines


def markdown(report):
    r = report
    lines = [f"# amp-patch doctor: {r.job} ({r.opt_level}, {r.half_dtype}, {r.steps} steps)", "",
             f"**{r.status.replace('_', ' ')}**: {r.summary}", ""]
    lines += _run_line("before", r.before)
    lines += _run_line("after the fix", r.after)
    if r.fp32_final_loss is not None:
        lines.append(f"- float32 (O0) final loss: {_fmt(r.fp32_final_loss)}")
    if r.intended:
        lines.append("- intended non-finite values (float32 holds them too, with a finite loss and gradients; not "
                     "counted as failures): " + ", ".join(r.intended[:4]) + (" and more" if len(r.intended) > 4
                                                                           else ""))
    lines += _culprit_table(r.culprits, r.half_dtype)
    if r.fixes:
        lines += ["", "## Op-list change", ""]
        lines += [f"- {f['target']}.{f['name']} -> float " + (f"in modules matching {f['scope']!r}" if f["scope"]
                                                            else "everywhere") for f in r.fixes]
    if r.op_list and r.status == "fixed":
        lines += ["", f"Written to {r.written}:" if r.written else "The op list (pass --out FILE to write it):",
                  "", "```yaml", r.op_list.rstrip(), "```"]
    if r.measure:
        lines += ["", f"Measure it against the list it extends (step time, loss): `{r.measure}`"]
    if r.log:
        lines += ["", "## Search", ""] + [f"    {line}" for line in r.log]
    if r.seconds:
        lines += ["", "Time: " + ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items())]
    return "\n".join(lines)
