"""What ``amp_patch.trace()`` reports of an ``fp8`` entry: calls run in float8 (with their scales) and calls that
fell back to the half dtype (shapes the scaled matmul cannot take, fp64 or integer arguments, batched matmuls)."""
import torch


class Fp8Counts:
    """fp8 calls, half fallbacks and the range of the scales seen, per operand (input ``a``, weight ``b``)."""

    def __init__(self):
        self.fp8 = self.fallback = 0
        self.recipe = None
        self.scales = {"a": [None, None], "b": [None, None]}  # operand -> [smallest, largest]

    def add_scale(self, operand, scale):
        low, high = scale.min().item(), scale.max().item()
        seen = self.scales[operand]
        seen[0] = low if seen[0] is None else min(seen[0], low)
        seen[1] = high if seen[1] is None else max(seen[1], high)

    def as_text(self):
        """``fp8 3, half fallback 1; scales a 1.2e+02..3.4e+02, b 5.6e+03``."""
        text = f"fp8 {self.fp8}" + (f" ({self.recipe})" if self.recipe else "") + f", half fallback {self.fallback}"
        ranges = [f"{name} {_range(*seen)}" for name, seen in self.scales.items() if seen[0] is not None]
        return text + (f"; scales {', '.join(ranges)}" if ranges else "")


def _range(low, high):
    return f"{low:.3g}" if low == high else f"{low:.3g}..{high:.3g}"


def fp8_recorder(tracer):
    """``record(a, quantized_b)`` for the fp8 wrapper's recording variant (``a`` None: a half fallback)."""
    from ..casting.fp8_numerics import RECIPES, scale_of

    def record(a, quantized_b, recipe="tensorwise"):
        row = tracer.current
        if row is None:
            return
        if row.fp8 is None:
            row.fp8 = Fp8Counts()
        counts = row.fp8
        if a is None:
            counts.fallback += 1
            return
        counts.fp8 += 1
        counts.recipe = recipe
        operand, _, pow2 = RECIPES[recipe]
        with torch.no_grad():
            counts.add_scale("a", scale_of(a, operand, None if recipe == "tensorwise" else -1, pow2))
        counts.add_scale("b", quantized_b[1])

    return record
