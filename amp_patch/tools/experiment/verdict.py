"""The experiment's verdict for one job: which variant to use, and which ones to distrust.

A variant is *within tolerance* when, at every step, its loss differs from fp32's by at most
``loss_tolerance`` (relative) times fp32's loss at that step, plus ``_ABS_SLACK`` (so that a loss near zero
does not make every difference count). Among the variants within tolerance that ran to the end, the verdict
names the one with the lowest step-time ratio to fp32 (fp32 itself counts 1.00x), and says whether that ratio
is significant: its min-max over the rounds excludes 1.00x. Variants beyond the tolerance, and those that
failed, diverged or timed out, are flagged.
"""
import math

LOSS_TOLERANCE = 0.05
_ABS_SLACK = 1e-3


def loss_gap(variant, fp32):
    """The largest ``|loss - fp32 loss| / |fp32 loss|`` over the steps (inf for a non-finite loss), or None."""
    if fp32 is None or fp32.get("status") not in ("ok", "interrupted") or not variant.get("losses"):
        return None
    gaps = []
    for mine, base in zip(variant["losses"], fp32["losses"]):
        if not isinstance(mine, float) or not isinstance(base, float):
            gaps.append(math.inf)
            continue
        gaps.append(max(0.0, abs(mine - base) - _ABS_SLACK) / max(abs(base), _ABS_SLACK))
    return max(gaps) if gaps else None


def verdict(variants, loss_tolerance=LOSS_TOLERANCE):
    """The verdict dict of one job's ``variants`` (report entries with ratios): ``fastest``, its ``ratio``,
    ``significant``, ``beyond_tolerance`` ({name: relative gap}), ``not_ok`` ({name: status}), ``text``."""
    fp32 = variants.get("fp32")
    gaps = {name: loss_gap(v, fp32) for name, v in variants.items()}
    not_ok = {name: v["status"] for name, v in variants.items() if v["status"] not in ("ok", "interrupted")}
    beyond = {name: gap for name, gap in gaps.items() if gap is not None and gap > loss_tolerance
              and name not in not_ok}
    candidates = [name for name, v in variants.items() if name not in not_ok and name not in beyond
                  and v.get("ratio_to_fp32") is not None]
    fastest = min(candidates, key=lambda n: variants[n]["ratio_to_fp32"], default=None)
    out = {"loss_tolerance": loss_tolerance, "fastest": fastest, "ratio": None, "significant": None,
           "beyond_tolerance": beyond, "not_ok": not_ok, "loss_gaps": gaps}
    if fastest is not None:
        out["ratio"] = variants[fastest]["ratio_to_fp32"]
        out["significant"] = bool(variants[fastest]["ratio_to_fp32_significant"])
    out["text"] = _text(out, variants)
    return out


def _label(name):
    return "O0 (fp32)" if name == "fp32" else name


def _text(v, variants):
    tolerance = f"{v['loss_tolerance']:.0%}"
    if "fp32" not in variants:
        head = "none without fp32 (O0), the reference for step time and loss: add it to --variants"
    elif v["fastest"] is None:
        head = f"no variant to recommend: none ran with its loss within {tolerance} of fp32's"
    elif v["fastest"] == "fp32" or v["ratio"] >= 1.0:
        head = (f"stay with {_label('fp32')}: no variant whose loss stays within {tolerance} of fp32's is faster "
                "here; `amp-patch speed --job MODULE:FUNCTION` shows what holds its step back (docs/speed.md)")
    else:
        rounds = "significant over the rounds" if v["significant"] else \
            "not significant: its rounds' min-max includes 1.00x"
        head = (f"{_label(v['fastest'])} is the fastest variant whose loss stays within {tolerance} of fp32's: "
                f"{v['ratio']:.2f}x fp32's step time ({rounds})")
    flags = [f"{_label(n)} loss gap {_pct(gap)} of fp32's loss exceeds {tolerance}" for n, gap in
             v["beyond_tolerance"].items()]
    flags += [f"{_label(n)} {status}" for n, status in v["not_ok"].items()]
    return "Verdict: " + head + ("; flagged: " + "; ".join(flags) if flags else "") + "."


def _pct(gap):
    return "inf" if math.isinf(gap) else f"{gap:.0%}"
