"""The speed report: :class:`SpeedReport` (what ``speed_report`` returns), its text and its JSON."""
import dataclasses
import json

HEALTHY = "nothing holds this job back"


@dataclasses.dataclass
class SpeedReport:
    """``findings`` (ranked :class:`~amp_patch.tools.speed.findings.Finding` objects), ``step_ms`` (median of
    the untimed-phase steps), ``machine``, ``phases`` (each phase's share of the step), ``overhead`` (the phase
    timers' measured cost: timed over plain steps, minus 1, the median over the schedule's units), its
    ``overhead_range`` over the units (the machine's noise) and ``probe_overhead`` (how much slower the probe steps
    ran; their times are not used) and ``half_hardware`` (whether the half dtype runs on hardware here)."""

    job: str
    opt_level: str
    half_dtype: str
    device: str
    steps: int
    step_ms: float
    machine: str
    findings: list
    phases: dict
    overhead: float
    overhead_range: list
    probe_overhead: float
    half_hardware: str = None  # whether the half dtype runs on hardware here (None at O0)

    def kinds(self):
        return [f.kind for f in self.findings]

    def as_dict(self):
        """The JSON document: ``{"findings": [{"kind", "share", "where", "figure", "fix"}], "step_ms", "machine",
        ...}``."""
        out = dataclasses.asdict(self)
        out["findings"] = [dataclasses.asdict(f) for f in self.findings]
        return out

    def to_json(self):
        return json.dumps(self.as_dict(), indent=2)

    def write_json(self, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    def to_text(self):
        return text(self)


def _share(share):
    return "" if share is None else f" ({share:.0%} of the step)" if share >= 0.01 else f" ({share:.1%} of the step)"


def text(report):
    dtype = "" if report.opt_level == "O0" else f" {report.half_dtype}"
    hardware = [f"half precision: {report.half_hardware}"] if report.half_hardware else []
    lines = [f"amp-patch speed: {report.job}, {report.opt_level}{dtype} on {report.device}, {report.steps} steps: "
             f"median step {report.step_ms:.2f} ms", f"machine: {report.machine}", *hardware,
             "step: " + ", ".join(f"{phase} {share:.0%}" for phase, share in report.phases.items())]
    if not report.findings:
        lines.append(f"\n{HEALTHY}: no data wait, host read, misaligned layer, DataParallel, cast, optimizer or "
                     "hardware cause above its threshold.")
    for number, finding in enumerate(report.findings, 1):
        lines += ["", f"{number}. {finding.kind}{_share(finding.share)}: {finding.where}",
                  f"   measured: {finding.figure}", f"   fix: {finding.fix}"]
    low, high = report.overhead_range
    lines += ["", f"instrumentation: the phase timers change the step time by {report.overhead:+.1%} (timed against "
              f"plain steps, interleaved; {low:+.0%}..{high:+.0%} over the units: the machine's noise); the probe "
              f"steps ran {report.probe_overhead:+.0%} against plain steps and are not used as step times."]
    return "\n".join(lines)
