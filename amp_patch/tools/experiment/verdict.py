"""The experiment's verdict for one job: which variant to use, and which ones to distrust.

A variant is *within tolerance* when, at every step, its loss differs from fp32's by at most
``loss_tolerance`` (relative) times fp32's loss at that step, plus ``_ABS_SLACK`` (so that a loss near zero
does not make every difference count). :func:`ranking` orders the variants by their step-time ratio to fp32
(fp32 itself counts 1.00x); the table lists its rows in that order and the verdict reads it. The verdict
recommends the first variant in the ranking that ran to the end within tolerance and whose lead is
*significant*: measured over at least :data:`MIN_ROUNDS` rounds, with a min-max over the rounds that excludes
1.00x. A lead that is not significant is never recommended: then the verdict says there is no significant
difference and to stay with fp32 (or measure longer). Variants beyond the tolerance, and those that failed,
diverged or timed out, are flagged.
"""
import math

LOSS_TOLERANCE = 0.05
_ABS_SLACK = 1e-3
#: the fewest rounds whose min-max can make a ratio significant (with 1 or 2 the spread says little)
MIN_ROUNDS = 3
_USABLE = ("ok", "interrupted")


def loss_gap(variant, fp32):
    """The largest ``max(0, |loss - fp32 loss| - _ABS_SLACK) / max(|fp32 loss|, _ABS_SLACK)`` over the steps: the
    gap beyond the absolute slack, relative to fp32's loss (inf for a non-finite loss; None without fp32 or
    losses). ``gap > loss_tolerance`` is the module's rule, ``|diff| > tolerance * |fp32 loss| + slack``."""
    if fp32 is None or fp32.get("status") not in _USABLE or not variant.get("losses"):
        return None
    gaps = []
    for mine, base in zip(variant["losses"], fp32["losses"]):
        if not isinstance(mine, float) or not isinstance(base, float):
            gaps.append(math.inf)
            continue
        gaps.append(max(0.0, abs(mine - base) - _ABS_SLACK) / max(abs(base), _ABS_SLACK))
    return max(gaps) if gaps else None


def ranking(variants):
    """The variant names, fastest first by step-time ratio to fp32 (fp32 1.00x); those without a ratio last,
    in their given order. The one order the table and the verdict use."""
    names = list(variants)
    return sorted(names, key=lambda n: (variants[n].get("ratio_to_fp32") is None,
                                        variants[n].get("ratio_to_fp32") or 0.0, names.index(n)))


def timed_rounds(variant):
    """How many rounds the ratio of ``variant`` to fp32 was taken over (else: its rounds that timed a step)."""
    counted = variant.get("ratio_to_fp32_rounds")
    return counted if counted is not None else sum(1 for r in variant.get("rounds") or () if r.get("median_step_ms"))


def verdict(variants, loss_tolerance=LOSS_TOLERANCE):
    """The verdict dict of one job's ``variants`` (report entries with ratios): ``fastest`` (the variant
    recommended, or None), its ``ratio``, ``significant``, ``leader`` (the lowest ratio within tolerance,
    significant or not), ``beyond_tolerance`` ({name: relative gap}), ``not_ok`` ({name: status}), ``text``."""
    fp32 = variants.get("fp32")
    gaps = {name: loss_gap(v, fp32) for name, v in variants.items()}
    not_ok = {name: v["status"] for name, v in variants.items() if v["status"] not in _USABLE}
    beyond = {name: gap for name, gap in gaps.items() if gap is not None and gap > loss_tolerance
              and name not in not_ok}
    candidates = [name for name in ranking(variants) if name not in not_ok and name not in beyond
                  and variants[name].get("ratio_to_fp32") is not None]
    leader = candidates[0] if candidates else None
    faster = [n for n in candidates if n != "fp32" and variants[n]["ratio_to_fp32"] < 1.0]
    fastest = next((n for n in faster if variants[n].get("ratio_to_fp32_significant")), None)
    if fastest is None and candidates and "fp32" in candidates:
        fastest = "fp32"
    out = {"loss_tolerance": loss_tolerance, "fastest": fastest, "ratio": None, "significant": None,
           "leader": leader, "beyond_tolerance": beyond, "not_ok": not_ok, "loss_gaps": gaps,
           "rounds": timed_rounds(variants[leader] if leader else fp32 or {}),
           "compared": [n for n in candidates if n != "fp32"]}
    if fastest is not None:
        out["ratio"] = variants[fastest]["ratio_to_fp32"]
        out["significant"] = bool(variants[fastest]["ratio_to_fp32_significant"])
    out["text"] = _text(out, variants)
    return out


def _label(name):
    return "O0 (fp32)" if name == "fp32" else name


def _text(v, variants):
    flags = [f"{_label(n)} loss gap {_pct(gap)} of fp32's loss exceeds {v['loss_tolerance']:.0%}" for n, gap in
             v["beyond_tolerance"].items()]
    flags += [f"{_label(n)} {status}" for n, status in v["not_ok"].items()]
    return "Verdict: " + _head(v, variants) + ("; flagged: " + "; ".join(flags) if flags else "") + "."


def _head(v, variants):
    tolerance, rounds = f"{v['loss_tolerance']:.0%}", v["rounds"]
    if "fp32" not in variants:
        return "none without fp32 (O0), the reference for step time and loss: add it to --variants"
    if v["fastest"] is None:
        fp32 = variants["fp32"]
        if fp32["status"] not in _USABLE or fp32.get("ratio_to_fp32") is None:
            return f"no variant to recommend: fp32 (O0), the reference, {fp32['status']} without a timed round"
        return f"no variant to recommend: none ran with its loss within {tolerance} of fp32's"
    if v["fastest"] != "fp32":
        name = v["fastest"]
        head = (f"{_label(name)} is the fastest variant whose loss stays within {tolerance} of fp32's: "
                f"{v['ratio']:.2f}x fp32's step time (significant over {_rounds(timed_rounds(variants[name]))})")
        if v["leader"] != name:
            head += f"; {_unproven(v['leader'], variants)}"
        return head
    if len(variants) == 1:
        return "only fp32 (O0) ran: nothing to compare"
    if not v["compared"]:
        return "nothing to compare: no variant besides fp32 (O0) finished a timed round within tolerance"
    leader = v["leader"]
    if leader != "fp32" and variants[leader]["ratio_to_fp32"] < 1.0:
        return (f"no significant difference over {_rounds(rounds)}: stay with fp32, "
                f"or rerun with more --rounds/--steps ({_unproven(leader, variants, tolerance)})")
    return (f"stay with {_label('fp32')}: no variant whose loss stays within {tolerance} of fp32's is faster here; "
            "`amp-patch speed --job MODULE:FUNCTION` shows what holds its step back (docs/speed.md)")


def _rounds(n):
    return f"{n} round{'s' if n != 1 else ''}" if n else "the rounds"


def _unproven(name, variants, tolerance=None):
    v = variants[name]
    low, high = v.get("ratio_to_fp32_min", v["ratio_to_fp32"]), v.get("ratio_to_fp32_max", v["ratio_to_fp32"])
    why = (f"its rounds' min-max {low:.2f}-{high:.2f} includes 1.00x" if low <= 1.0 <= high else
           (f"only {_rounds(timed_rounds(v))}, and a min-max needs at least {MIN_ROUNDS}" if timed_rounds(v) else
            f"a min-max needs at least {MIN_ROUNDS} rounds"))
    within = f", whose loss stays within {tolerance} of fp32's," if tolerance else ""
    return f"{_label(name)}{within} measured {v['ratio_to_fp32']:.2f}x, not significant: {why}"


def _pct(gap):
    return "inf" if math.isinf(gap) else f"{gap:.0%}"
