"""The planner's decision, pure: observations in, instances per role out (docs/planner.md).

Each interval the service hands `Planner.step` one `Observation` (what the gateways and the registry showed over
the interval). The planner
  1. predicts the next interval's load: arrival rate by Holt's linear smoothing (level + trend, so a ramp is met
     ahead of it), looked `lead_s` ahead (the time a new instance takes to serve); lengths and cache-hit share by
     exponential smoothing;
  2. sizes each role from a step-cost profile (the mock engine's table, fitted by `python -m bench.profile`) and
     the KV arithmetic the pools report:
       decode   sequences per instance B = the most whose step stays within the ITL target, and no more than fit
                the KV pools at the observed units per running sequence (a hybrid-SWA sequence holds O(window) in
                its SWA layers, so the pools' own accounting is the SWA-aware figure); an instance generates
                B / step(B) tokens per second;
       prefill  an instance computes one request's uncached tokens in t_p; it may be busy at most rho, where
                queueing keeps the TTFT p90 within its target (an M/M/1 tail: t_p (1 + ln 10 rho / (1 - rho)));
       worker   (prefill + decode in one process) both on one clock: rho = rate (t_p + out x step(B) / B);
     then adds one instance to a role whose observed p90 misses its target while requests wait (the model was
     wrong: the observation wins) and raises a correction factor on every later need by 15% (up to 2x; it
     eases back 1% per interval in which every target holds);
  3. applies hysteresis: up at once to what is needed (less UP_SLACK); down one instance at a time, only after
     `down_after` intervals in a row that needed fewer (judged on the higher of the load now and ahead, plus
     DOWN_MARGIN) and `cooldown_s` after the last change up, so a ramp does not flap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from libs.engine.mock_profile import MockProfile

ROLES = ("worker", "prefill", "decode")
"""The roles the planner sizes (an encoder, a cache node, a router or a gateway is sized by hand)."""
LN10 = math.log(10.0)
DOWN_MARGIN = 0.1  # a step down must leave this much more than the load needs
UP_SLACK = 0.15  # a need this far over a whole number of instances does not add one (noise at the boundary)
CORRECTION_UP, CORRECTION_EASE, MAX_CORRECTION = 1.15, 0.99, 2.0  # the model's calibration by observed misses


@dataclass(frozen=True)
class Sla:
    ttft_p90_s: float
    itl_p90_s: float


@dataclass(frozen=True)
class RoleLoad:
    """One role's instances as the registry shows them (summed over the role's live instances)."""

    instances: int = 0
    running: int = 0
    waiting: int = 0
    kv_units_used: int = 0
    kv_units_total: int = 0


@dataclass(frozen=True)
class Observation:
    """One interval as the gateways and the registry showed it."""

    interval_s: float
    finished: float = 0.0  # requests finished in the interval
    in_system_delta: float = 0.0  # change of requests in flight or queued at the gateways over the interval
    prompt_tokens: float = 0.0  # of the finished requests
    cached_tokens: float = 0.0
    output_tokens: float = 0.0
    ttft_p90_s: float | None = None  # over the interval (None: no request had a first token)
    itl_p90_s: float | None = None
    roles: dict[str, RoleLoad] = field(default_factory=dict)

    @property
    def arrival_rate(self) -> float:
        """Requests per second that arrived: those finished plus the growth of those still in the system."""
        return max(0.0, (self.finished + self.in_system_delta) / self.interval_s)


@dataclass(frozen=True)
class LoadForecast:
    rate: float  # requests per second, `lead_s` ahead
    prompt: float  # mean prompt tokens
    cached_share: float  # of prompt tokens
    output: float  # mean output tokens


@dataclass(frozen=True)
class PlannerSettings:
    sla: Sla
    limits: dict[str, tuple[int, int]]  # role -> (min, max); a role absent here is not sized
    profile: MockProfile
    interval_s: float = 5.0
    lead_s: float = 10.0
    utilization: float = 0.75  # the busiest an instance is planned to be (headroom for bursts)
    down_after: int = 3  # intervals in a row that need fewer before one instance goes
    cooldown_s: float = 30.0  # no step down this soon after a step up
    alpha: float = 0.5  # Holt: level smoothing
    beta: float = 0.3  # Holt: trend smoothing
    max_batch: int = 256  # decode sequences per instance at most (the scheduler's own bound)


@dataclass
class Holt:
    """Holt's linear exponential smoothing of one series sampled once per interval."""

    alpha: float
    beta: float
    level: float | None = None
    trend: float = 0.0

    def update(self, x: float) -> None:
        if self.level is None:
            self.level = x
            return
        previous = self.level
        self.level = self.alpha * x + (1 - self.alpha) * (previous + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def forecast(self, steps: float) -> float:
        return max(0.0, (self.level or 0.0) + self.trend * steps)


@dataclass
class Ewma:
    alpha: float
    value: float | None = None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


def decode_step_s(p: MockProfile, batch: int, context: float) -> float:
    """One decode step of `batch` sequences of `context` keys each."""
    return p.predict(batch, batch * context)


def prefill_s(p: MockProfile, uncached: float, cached: float) -> float:
    """One request's prefill: its uncached tokens, attending to the cached ones and to each other."""
    return p.predict(uncached, uncached * (cached + uncached / 2), 1)


def decode_batch(s: PlannerSettings, context: float, units_per_seq: float | None, units_total: float) -> int:
    """Sequences one decode instance runs at once: within the ITL target and the KV pools (at least 1)."""
    p = s.profile
    per_seq = p.per_token_s + p.per_pair_s * context
    by_itl = int((s.sla.itl_p90_s - p.fixed_s) / per_seq) if per_seq > 0 else s.max_batch
    by_kv = int(units_total / units_per_seq) if units_per_seq and units_total else s.max_batch
    return max(1, min(by_itl, by_kv, s.max_batch))


def busy_bound(s: PlannerSettings, t_prefill: float) -> float:
    """The busiest (share of time) an instance that prefills may be so that the TTFT p90 stays in its target."""
    x = (s.sla.ttft_p90_s / t_prefill - 1) / LN10 if t_prefill > 0 else math.inf
    return min(s.utilization, x / (1 + x)) if x > 0 else s.utilization


def needed(s: PlannerSettings, pred: LoadForecast, kv: dict[str, RoleLoad]) -> dict[str, float]:
    """Instances per role (fractional) the predicted load needs."""
    uncached = pred.prompt * (1 - pred.cached_share)
    t_p = prefill_s(s.profile, uncached, pred.prompt - uncached)
    context = pred.prompt + pred.output / 2
    out: dict[str, float] = {}
    for role in ("worker", "decode"):
        load = kv.get(role, RoleLoad())
        units_per_seq = load.kv_units_used / load.running if load.running else None
        total = load.kv_units_total / load.instances if load.instances else 0
        batch = decode_batch(s, context, units_per_seq, total)
        per_token = decode_step_s(s.profile, batch, context) / batch  # instance-seconds per generated token
        if role == "decode":
            out[role] = pred.rate * pred.output * per_token / s.utilization
        else:
            out[role] = pred.rate * (t_p + pred.output * per_token) / busy_bound(s, t_p)
    out["prefill"] = pred.rate * t_p / busy_bound(s, t_p)
    return out


@dataclass
class RoleState:
    desired: int
    below: int = 0  # intervals in a row that needed fewer
    last_up_at: float = -math.inf
    changes: list[tuple[float, int]] = field(default_factory=list)  # (time, +1 / -1)


@dataclass(frozen=True)
class Decision:
    at: float
    prediction: LoadForecast
    needed: dict[str, float]  # by the model, before the observation's correction and the limits
    desired: dict[str, int]
    reasons: dict[str, str]


class Planner:
    """Feed one observation per interval (`step`); read the desired instances per role from its decision."""

    def __init__(self, settings: PlannerSettings, start: dict[str, int] | None = None) -> None:
        self.s = settings
        self.rate = Holt(settings.alpha, settings.beta)
        self.prompt, self.output, self.cached = Ewma(0.5), Ewma(0.5), Ewma(0.5)
        start = start or {}
        self.roles = {r: RoleState(max(lo, min(hi, start.get(r, lo)))) for r, (lo, hi) in settings.limits.items()}
        self.correction = 1.0
        """The model's needs are multiplied by this: raised each time an observed p90 missed with requests
        waiting (the model was optimistic here: the host's own overheads, a slower device), eased back while
        every target holds."""

    def predict(self, obs: Observation) -> LoadForecast:
        self.rate.update(obs.arrival_rate)
        if obs.finished > 0:
            self.prompt.update(obs.prompt_tokens / obs.finished)
            self.output.update(obs.output_tokens / obs.finished)
            if obs.prompt_tokens > 0:
                self.cached.update(min(1.0, obs.cached_tokens / obs.prompt_tokens))
        steps = self.s.lead_s / self.s.interval_s
        return LoadForecast(self.rate.forecast(steps), self.prompt.value or 0.0, self.cached.value or 0.0,
                          self.output.value or 0.0)

    def step(self, obs: Observation, now: float) -> Decision:
        pred = self.predict(obs)
        need = {r: n * self.correction for r, n in needed(self.s, pred, obs.roles).items()}
        # a step down is judged on the load now or ahead, whichever is higher, with a margin: a forecast that
        # overshot at the top of a ramp does not take an instance that the next interval wants back
        keep = replace(pred, rate=max(pred.rate, self.rate.level or 0.0) * (1 + DOWN_MARGIN))
        need_keep = {r: n * self.correction for r, n in needed(self.s, keep, obs.roles).items()}
        missed = False
        desired: dict[str, int] = {}
        reasons: dict[str, str] = {}
        for role, st in self.roles.items():
            lo, hi = self.s.limits[role]
            target, why = math.ceil(need[role] - UP_SLACK), "model"
            if target < st.desired:
                target = min(st.desired, math.ceil(need_keep[role] - 1e-9))
            load = obs.roles.get(role, RoleLoad())
            late = ((role in ("worker", "prefill") and _missed(obs.ttft_p90_s, self.s.sla.ttft_p90_s))
                    or (role in ("worker", "decode") and _missed(obs.itl_p90_s, self.s.sla.itl_p90_s)))
            if late and load.waiting > 0:
                missed = True
                if target <= st.desired:
                    target, why = st.desired + 1, "p90 over target with requests waiting"
            target = max(lo, min(hi, target))
            if target > st.desired:
                st.changes.append((now, +1))
                st.desired, st.below, st.last_up_at = target, 0, now
                why = f"up: {why}"
            elif target < st.desired:
                st.below += 1
                if st.below >= self.s.down_after and now - st.last_up_at >= self.s.cooldown_s:
                    st.changes.append((now, -1))
                    st.desired, st.below, why = st.desired - 1, 0, f"down: {why} needs {target}"
                else:
                    why = f"hold: needs {target} ({st.below}/{self.s.down_after} intervals)"
            else:
                st.below, why = 0, "hold"
            desired[role], reasons[role] = st.desired, why
        met = not (_missed(obs.ttft_p90_s, self.s.sla.ttft_p90_s) or _missed(obs.itl_p90_s, self.s.sla.itl_p90_s))
        if missed:
            self.correction = min(MAX_CORRECTION, self.correction * CORRECTION_UP)
        elif met:
            self.correction = max(1.0, self.correction * CORRECTION_EASE)
        return Decision(now, pred, need, desired, reasons)


def _missed(observed: float | None, target: float) -> bool:
    return observed is not None and observed > target


def direction_changes(changes: list[tuple[float, int]]) -> int:
    """How often a role's steps turned from up to down or back."""
    signs = [d for _, d in changes]
    return sum(a != b for a, b in zip(signs, signs[1:], strict=False))
