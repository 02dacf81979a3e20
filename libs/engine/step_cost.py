"""Online step-cost model (pure): predicts how long a step takes from what it computes.

    seconds ~= fixed + per_token * new_tokens + per_pair * attention_pairs

where attention_pairs = sum over sequences of q_len * kv_len (the query/key pairs attention visits). The
engine reports every step's measured time; the model refits by least squares over a sliding window.
The scheduler uses it to size long-bucket prefill chunks in *time*, not tokens: on small models or CPUs a
step has a large fixed cost, and a long chunk's tokens cost more than short ones (they attend a long
context), so a token-proportional cap misjudges both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Too few or too uniform samples give a meaningless fit; callers then fall back to token shares.
MIN_SAMPLES = 8
REFIT_EVERY = 8


@dataclass(frozen=True)
class CostFit:
    fixed: float
    per_token: float
    per_pair: float

    def predict(self, tokens: int, pairs: int) -> float:
        return self.fixed + self.per_token * tokens + self.per_pair * pairs

    def chunk_cost(self, n: int, prefix: int) -> float:
        """Extra time of adding n new tokens of a sequence with `prefix` tokens already computed."""
        return self.per_token * n + self.per_pair * n * (prefix + n)

    def max_chunk(self, budget_s: float, prefix: int, limit: int) -> int:
        """Largest n <= limit whose chunk_cost fits budget_s (cost grows with n: binary search)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.chunk_cost(mid, prefix) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


class StepCostModel:
    """Sliding-window least-squares fit of step time on (new tokens, attention pairs)."""

    def __init__(self, window: int = 256) -> None:
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._since_fit = 0
        self.fit: CostFit | None = None

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._samples.append((tokens, pairs, seconds))
        self._since_fit += 1
        if len(self._samples) >= MIN_SAMPLES and (self.fit is None or self._since_fit >= REFIT_EVERY):
            self._since_fit = 0
            self.fit = fit_step_cost(list(self._samples)) or self.fit


def fit_step_cost(samples: list[tuple[int, int, float]]) -> CostFit | None:
    """Least squares with non-negative slopes (a tiny ridge keeps collinear samples solvable).

    Returns None when the samples cannot separate a fixed cost from a per-token cost."""
    if len({s[0] for s in samples}) < 2:
        return None
    fit = _solve(samples, use_pairs=True)
    if fit is None or fit.per_pair < 0 or fit.per_token < 0:
        fit = _solve(samples, use_pairs=False)
    if fit is None or fit.fixed < 0 or fit.per_token < 0:
        return None
    return fit


def _solve(samples: list[tuple[int, int, float]], use_pairs: bool) -> CostFit | None:
    rows = [(1.0, float(t), float(p) if use_pairs else 0.0) for t, p, _ in samples]
    ys = [s for _, _, s in samples]
    k = 3 if use_pairs else 2
    # scale columns so the ridge term means the same for every coefficient
    scale = [max(max(abs(r[j]) for r in rows), 1e-12) for j in range(k)]
    a = [[sum(r[i] * r[j] for r in rows) / (scale[i] * scale[j]) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) / scale[i] for i in range(k)]
    for i in range(k):
        a[i][i] += 1e-9 * len(rows)
    x = _gauss(a, b)
    if x is None:
        return None
    coef = [x[j] / scale[j] for j in range(k)] + [0.0] * (3 - k)
    return CostFit(coef[0], coef[1], coef[2])


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-15:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [vr - f * vc for vr, vc in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]
