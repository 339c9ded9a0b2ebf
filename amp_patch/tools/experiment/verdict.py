"""The experiment's verdict for one job: which variant to use, and which ones to distrust.

A variant is *within tolerance* when, at every step, its loss differs from fp32's by at most
``loss_tolerance`` (relative) times fp32's loss at that step, plus ``_ABS_SLACK`` (so that a loss near zero
does not make every difference count). :func:`ranking` orders the variants by the step time the table shows
(the median over the rounds; ties and rows without one by their ratio to fp32); the table lists its rows in that
order and the verdict reads it.

One rule for every claim that a variant is faster than another (fp32 included): its lead is *significant*, the
per-round ratio of the two (round i against round i) measured over at least :data:`MIN_ROUNDS` rounds with a
min-max that excludes 1.00x (:func:`pair_ratio`). The verdict recommends the first variant in the ranking that
ran to the end within tolerance and is significantly faster than fp32; it calls it *the fastest* only when its
lead over every other such variant is significant too, and else names the ones it cannot tell apart. Two
variants that computed the same thing (the same losses bitwise, the same casts: :func:`identical`) are said to
be identical, never one faster than the other. A lead that is not significant is never recommended: then the
verdict says there is no significant difference and to stay with fp32 (or measure longer). Variants beyond the
tolerance, and those that failed, diverged or timed out, are flagged.
"""
import math
import statistics

LOSS_TOLERANCE = 0.05
#: the share of weights a step leaves unchanged (nonzero gradient) from which a variant is flagged for lost updates
LOST_UPDATES = 0.05
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
    """The variant names, fastest first by the median step time the table shows; ties, and those without one,
    by their step-time ratio to fp32 (fp32 1.00x); those with neither last, in their given order. The one order
    the table and the verdict use."""
    names = list(variants)

    def key(n):
        ms, ratio = variants[n].get("median_step_ms"), variants[n].get("ratio_to_fp32")
        return (ratio is None and ms is None, ms is None, ms or 0.0, ratio is None, ratio or 0.0, names.index(n))
    return sorted(names, key=key)


def pair_ratio(a, b):
    """Variant ``a``'s step time over ``b``'s, round by round: ``{"ratio" (median), "low", "high", "rounds",
    "significant"}`` (significant: at least MIN_ROUNDS rounds and a min-max excluding 1.00x); None when no round
    timed both."""
    per_round = [x["median_step_ms"] / y["median_step_ms"] for x, y in zip(a.get("rounds") or (), b.get("rounds") or ())
                 if x.get("median_step_ms") and y.get("median_step_ms")]
    if not per_round:
        return None
    low, high = min(per_round), max(per_round)
    return {"ratio": statistics.median(per_round), "low": low, "high": high, "rounds": len(per_round),
            "significant": len(per_round) >= MIN_ROUNDS and not low <= 1.0 <= high}


def identical(a, b):
    """Whether two variants computed the same thing: the same losses bitwise at every step and the same casts
    per iteration (all of them, and of weights); their step times can then differ by the machine's noise only."""
    keys = ("casts_per_iteration", "weight_casts_per_iteration")
    return (bool(a.get("losses")) and a.get("losses") == b.get("losses")
            and a.get("loss_scales") == b.get("loss_scales")
            and all(a.get(k) is not None and a.get(k) == b.get(k) for k in keys))


def identical_groups(variants, names):
    """Groups (lists of two or more names, in ``names``' order) of variants that computed identically."""
    groups = []
    for name in names:
        group = next((g for g in groups if identical(variants[g[0]], variants[name])), None)
        if group is None:
            groups.append([name])
        else:
            group.append(name)
    return [g for g in groups if len(g) > 1]


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
    same = identical_groups(variants, [n for n in ranking(variants) if n not in not_ok])
    as_fp32 = next((g for g in same if "fp32" in g), [])
    faster = [n for n in candidates if n != "fp32" and variants[n]["ratio_to_fp32"] < 1.0 and n not in as_fp32]
    fastest = next((n for n in faster if variants[n].get("ratio_to_fp32_significant")), None)
    noisy = _noisy_twins(variants, same)
    if noisy:  # two identical computations measured apart: the step times are noise, no lead is real
        fastest = None
    if fastest is None and candidates and "fp32" in candidates and not noisy:
        fastest = "fp32"
    out = {"loss_tolerance": loss_tolerance, "fastest": fastest, "ratio": None, "significant": None,
           "leader": leader, "beyond_tolerance": beyond, "not_ok": not_ok, "loss_gaps": gaps,
           "rounds": timed_rounds(variants[leader] if leader else fp32 or {}),
           "compared": [n for n in candidates if n != "fp32"], "identical": same, "ties": [], "beaten": [],
           "noisy": noisy}
    if fastest not in (None, "fp32"):
        out["ties"], out["beaten"] = _against_others(fastest, candidates, variants, same)
    if fastest is not None:
        out["ratio"] = variants[fastest]["ratio_to_fp32"]
        out["significant"] = bool(variants[fastest]["ratio_to_fp32_significant"])
    out["text"] = _text(out, variants)
    return out


def _noisy_twins(variants, same):
    """``[(a, b, pair)]``: identical computations whose step times differ significantly (every round one way): the
    machine's noise, which then outweighs any lead the rounds show."""
    found = []
    for group in same:
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                pair = pair_ratio(variants[a], variants[b])
                if pair is not None and pair["significant"]:
                    found.append((a, b, pair))
    return found


def _against_others(fastest, candidates, variants, same):
    """The other candidates (fp32 aside) ``fastest``'s lead over is not significant (``ties``: [(name, pair)])
    and is (``beaten``); those computing identically to it are neither."""
    twins = next((g for g in same if fastest in g), [])
    ties, beaten = [], []
    for name in candidates:
        if name in ("fp32", fastest) or name in twins:
            continue
        pair = pair_ratio(variants[fastest], variants[name])
        if pair is not None and pair["significant"] and pair["ratio"] < 1.0 or \
                pair is None and _apart(variants[fastest], variants[name]):
            beaten.append(name)
        else:
            ties.append((name, pair))
    return ties, beaten


def _apart(a, b):
    """Without rounds timed by both (a report built from ratios alone): ``a``'s rounds' ratios to fp32 all at or
    below ``b``'s, both significant against fp32."""
    high, low = a.get("ratio_to_fp32_max"), b.get("ratio_to_fp32_min")
    return (high is not None and low is not None and a.get("ratio_to_fp32_significant") is True
            and b.get("ratio_to_fp32_significant") is True and high <= low)


def _label(name):
    return "O0 (fp32)" if name == "fp32" else name


def _text(v, variants):
    flags = [f"{_label(n)} loss gap {_pct(gap)} of fp32's loss exceeds {v['loss_tolerance']:.0%}" for n, gap in
             v["beyond_tolerance"].items()]
    flags += [f"{_label(n)} {status}" for n, status in v["not_ok"].items()]
    flags += [f"{_label(n)} lost updates: {_lost_text(variants[n])}" for n in variants if n not in v["not_ok"]
              and (variants[n].get("unchanged_by_update") or 0.0) >= LOST_UPDATES]
    said = {a for a, _, _ in v["noisy"]}  # the head already says these compute identically
    same = [_same_text(group, variants) for group in v["identical"] if not said & set(group)]
    same += _rising_reference(variants)
    return ("Verdict: " + _head(v, variants) + "".join(f"; {text}" for text in same)
            + ("; flagged: " + "; ".join(flags) if flags else "") + ".")


def _rising_reference(variants):
    """A note when fp32's own loss ends above where it started: the reference diverges, gaps to it say little."""
    fp32 = variants.get("fp32") or {}
    losses = [x for x in fp32.get("losses") or () if isinstance(x, float)]
    if fp32.get("status") not in _USABLE or len(losses) < 2 or not losses[-1] > losses[0] * 1.05:
        return []
    return [f"the reference diverges: fp32's own loss rose from {losses[0]:.4g} to {losses[-1]:.4g} over "
            f"{len(losses)} steps (lower the learning rate), so the loss gaps to it say little"]


def _same_text(group, variants):
    casts = variants[group[0]].get("casts_per_iteration")
    names = [_label(n) for n in group]
    return (f"{', '.join(names[:-1])} and {names[-1]} compute identically (the same losses bitwise, the same "
            f"{casts:g} casts per iteration): one computation, and their step times differ by the machine's noise "
            "only")


def _head(v, variants):
    tolerance, rounds = f"{v['loss_tolerance']:.0%}", v["rounds"]
    if "fp32" not in variants:
        return "none without fp32 (O0), the reference for step time and loss: add it to --variants"
    if v["noisy"]:
        a, b, pair = v["noisy"][0]
        return (f"no variant to recommend: the step times are the machine's noise here, {_label(a)} and {_label(b)} "
                f"compute identically yet measured {pair['ratio']:.2f}x apart (per round {pair['low']:.2f}-"
                f"{pair['high']:.2f}x): rerun " + ("" if variants[a].get("isolated") else
                                                  "in separate processes (without --no-isolate), ")
                + "with more --rounds and --threads 1, on a quieter machine")
    if v["fastest"] is None:
        fp32 = variants["fp32"]
        if fp32["status"] not in _USABLE or fp32.get("ratio_to_fp32") is None:
            return f"no variant to recommend: fp32 (O0), the reference, {fp32['status']} without a timed round"
        return f"no variant to recommend: none ran with its loss within {tolerance} of fp32's"
    if v["fastest"] != "fp32":
        return _recommended(v, variants, tolerance)
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


def _recommended(v, variants, tolerance):
    name = v["fastest"]
    twins = [n for g in v["identical"] if name in g for n in g if n != name]
    label = _label(name) + (f" (the same computation as {_names(twins)})" if twins else "")
    figure = (f"{v['ratio']:.2f}x fp32's step time (significant over {_rounds(timed_rounds(variants[name]))})")
    figure += _lost_caveat(name, variants[name])
    if not v["ties"]:
        head = f"{label} is the fastest variant whose loss stays within {tolerance} of fp32's: {figure}"
        return head + (f", and significantly faster than {_names(v['beaten'])} too" if v["beaten"] else "")
    head = f"{label} is significantly faster than fp32 with its loss within {tolerance} of fp32's: {figure}"
    proven = [(n, pair) for n, pair in v["ties"] if variants[n].get("ratio_to_fp32_significant")]
    if proven:
        head += (f"; so is {_names([n for n, _ in proven])}, and the lead between them is not significant, so "
                 "either will do (" + "; ".join(_tie_text(name, n, pair, variants) for n, pair in proven) + ")")
    return head + "".join(f"; {_unproven(n, variants)}" for n, _ in v["ties"] if (n, _) not in proven)


def _lost_text(variant):
    share = variant["unchanged_by_update"]
    return (f"a step left {share:.0%} of the weights with a nonzero gradient unchanged (updates below the weights' "
            "resolution are lost; a loss over a few steps cannot show it)")


def _lost_caveat(name, variant):
    """The lost-updates figure of a recommended variant: always for O3 (half weights), else when it is high."""
    share = variant.get("unchanged_by_update")
    if share is None:
        return ", its lost updates not measured (its last step was skipped or did not run)" if name == "O3" else ""
    if share >= LOST_UPDATES:
        return (f", but {_lost_text(variant)}: check its loss over a longer run, or use O2 (float32 masters keep "
                "every update)")
    return f", and a step left {share:.1%} of its weights unchanged (no lost updates)" if name == "O3" else ""


def _names(names):
    labels = [_label(n) for n in names]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"


def _tie_text(name, other, pair, variants):
    against = f"{_label(other)} {variants[other]['ratio_to_fp32']:.2f}x fp32's"
    if pair is None:
        return f"{against}, and no round timed both"
    why = (f"min-max {pair['low']:.2f}-{pair['high']:.2f} includes 1.00x" if pair["low"] <= 1.0 <= pair["high"] else
           f"only {_rounds(pair['rounds'])}, and a min-max needs at least {MIN_ROUNDS}")
    return f"{against}; {_label(name)} over {_label(other)} per round {pair['ratio']:.2f}x, {why}"


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
