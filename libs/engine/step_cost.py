"""Online step-cost model (pure): predicts how long a step takes from what it computes.

    seconds ~= fixed + per_token * new_tokens + per_pair * attention_pairs + per_seq * prefill_sequences

where attention_pairs = sum over sequences of q_len * kv_len and prefill_sequences counts the step's prefill
chunks (each has a cost independent of its length). The engine reports every step's measured time; the
model refits by least squares over a sliding window. The scheduler uses it to size long-bucket prefill
chunks in time rather than tokens, since fixed per-step cost and long-context attention make a token count
a poor proxy.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

# Too few or too uniform samples give a meaningless fit; callers then fall back to token shares.
MIN_SAMPLES = 8
REFIT_EVERY = 8


@dataclass(frozen=True)
class CostFit:
    fixed: float
    per_token: float
    per_pair: float
    per_seq: float = 0.0

    def predict(self, tokens: float, pairs: float, seqs: float = 0) -> float:
        return self.fixed + self.per_token * tokens + self.per_pair * pairs + self.per_seq * seqs

    def chunk_cost(self, n: int, prefix: int) -> float:
        """Extra time of adding a prefill chunk of n tokens, `prefix` tokens already computed (0 for n = 0)."""
        if n <= 0:
            return 0.0
        return self.per_seq + self.per_token * n + self.per_pair * n * (prefix + n)

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
    """Sliding-window least-squares fit of step time on (new tokens, attention pairs, prefill sequences).

    The normal equations are kept as running sums (the evicted sample is subtracted), so a refit solves a
    4x4 system instead of summing over the window; the sums are rebuilt from the window every `window`
    observations so rounding cannot drift."""

    def __init__(self, window: int = 256) -> None:
        self._samples: deque[tuple[int, int, float, int]] = deque(maxlen=window)
        self._sums = _Sums()
        self._since_fit = 0
        self._since_rebuild = 0
        self.fit: CostFit | None = None

    def observe(self, tokens: int, pairs: int, seconds: float, seqs: int = 0) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        sample = (tokens, pairs, seconds, seqs)
        if len(self._samples) == self._samples.maxlen:
            self._sums.add(self._samples[0], -1)
        self._samples.append(sample)
        self._sums.add(sample, 1)
        self._since_rebuild += 1
        if self._since_rebuild >= (self._samples.maxlen or 1):
            self._since_rebuild = 0
            self._sums = _Sums.of(self._samples)
        self._since_fit += 1
        if len(self._samples) >= MIN_SAMPLES and (self.fit is None or self._since_fit >= REFIT_EVERY):
            self._since_fit = 0
            self.fit = _fit(self._sums) or self.fit


class _Sums:
    """Sums of x x^T and x y over samples, x = (1, tokens, pairs, seqs), y = seconds; distinct values seen."""

    def __init__(self) -> None:
        self.n = 0
        self.xx = [[0.0] * 4 for _ in range(4)]
        self.xy = [0.0] * 4
        self.tokens: Counter[int] = Counter()
        self.seqs: Counter[int] = Counter()

    @classmethod
    def of(cls, samples) -> _Sums:
        sums = cls()
        for sample in samples:
            sums.add(sample, 1)
        return sums

    def add(self, sample: tuple[int, int, float, int], sign: int) -> None:
        t, p, y, q = sample
        x = (1.0, float(t), float(p), float(q))
        for i in range(4):
            self.xy[i] += sign * x[i] * y
            row = self.xx[i]
            for j in range(4):
                row[j] += sign * x[i] * x[j]
        self.n += sign
        for counter, key in ((self.tokens, t), (self.seqs, q)):
            counter[key] += sign
            if counter[key] <= 0:
                del counter[key]


def fit_step_cost(samples: list[tuple[int, int, float, int]]) -> CostFit | None:
    """Least squares with non-negative slopes (a tiny ridge keeps collinear samples solvable).

    Samples are (tokens, pairs, seconds, prefill sequences). Active set: while a slope comes out negative,
    the most negative one (by its contribution to the mean step) is fixed at 0 and the rest refit. The
    per-sequence term is fitted only when the samples vary in it (else it would share the fixed cost).
    Returns None when the samples cannot separate a fixed cost from a positive per-token cost."""
    return _fit(_Sums.of(samples))


def _fit(sums: _Sums) -> CostFit | None:
    if len(sums.tokens) < 2:
        return None
    slopes = [1, 2] + ([3] if len(sums.seqs) >= 2 else [])
    means = [sums.xx[0][c] / sums.n for c in range(4)]
    while True:
        fit = _solve(sums, slopes)
        if fit is None:
            return None
        coef = (fit.fixed, fit.per_token, fit.per_pair, fit.per_seq)
        negative = [c for c in slopes if coef[c] < 0]
        if not negative:
            break
        worst = min(negative, key=lambda c: coef[c] * means[c])
        if worst == 1:
            return None  # tokens that make a step cheaper: the samples are noise
        slopes.remove(worst)
    return fit if fit.fixed >= 0 else None


def _solve(sums: _Sums, slopes: list[int]) -> CostFit | None:
    """Least squares over the intercept and the given slope columns (1 tokens, 2 pairs, 3 sequences)."""
    cols = [0, *slopes]
    # scale columns (by their root mean square) so the ridge term means the same for every coefficient
    scale = [max(sums.xx[c][c] / sums.n, 1e-24) ** 0.5 for c in cols]
    a = [[sums.xx[ci][cj] / (si * sj) for cj, sj in zip(cols, scale, strict=True)]
         for ci, si in zip(cols, scale, strict=True)]
    b = [sums.xy[c] / sc for c, sc in zip(cols, scale, strict=True)]
    for i in range(len(cols)):
        a[i][i] += 1e-9 * sums.n
    x = _gauss(a, b)
    if x is None:
        return None
    coef = [0.0] * 4
    for j, col in enumerate(cols):
        coef[col] = x[j] / scale[j]
    return CostFit(coef[0], coef[1], coef[2], coef[3])


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
