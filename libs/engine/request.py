"""Request-side types shared by the scheduler, the runner and the services.

Pure: no torch. A `Request` is what a caller submits; a `RequestOutput` is what one
engine step hands back per request (the tokens produced in that step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple


class FinishReason(StrEnum):
    """Why a request stopped producing tokens."""

    STOP = "stop"  # a stop token or stop string was produced
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller
    PREFILLED = "prefilled"  # prefill-only request: first token produced, KV held until release()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature == 0 (or top_k == 1) means greedy. `seed` makes sampling reproducible per request
    (its own generator); without a seed the engine-wide generator is used. `logprobs`: None = no
    logprobs, k >= 0 = the sampled token's logprob plus the top-k alternatives.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"SamplingParams.logprobs must be None or >= 0, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy without logprobs: the token is the argmax and nothing else is computed."""
        return self.logprobs is None and self.greedy


@dataclass
class Request:
    """One generation request. `prompt_token_ids` must be non-empty.

    prefill_only: stop after the first token and keep the KV pages until `EngineCore.release()`
    (used by a disaggregated prefill worker that ships the KV to a decode worker).
    on_progress: called on the engine thread after every step that computed some of this request's KV
    (once that step is committed), with a `PrefillProgress`. It runs inside the step loop: it must be quick
    and must not raise (the engine logs and aborts the request if it does).
    """

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    prefill_only: bool = False
    on_progress: Callable[[PrefillProgress], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if not self.req_id:
            raise ValueError("Request.req_id must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r}: prompt_token_ids is empty")


@dataclass(frozen=True)
class PrefillProgress:
    """A request's KV after a committed step: tokens [0, num_computed) are final in these pages (logical page
    j -> physical page id; -1 in `swa_pages` where no SWA KV is held). Valid during the hook call only:
    the next step may preempt the request and reuse the pages."""

    num_computed: int
    full_pages: Sequence[int]
    swa_pages: Sequence[int]


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of a produced token, plus the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestOutput(NamedTuple):
    """What one engine step produced for one request.

    new_token_ids: tokens produced in this step (one per step today; a list so speculative
    decoding can add more). num_cached_tokens: prompt tokens served from the prefix cache at the
    request's (first) admission. (A NamedTuple: immutable, and cheap to build once per sequence per step.)
    """

    req_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int


class AdmittedHit(NamedTuple):
    """A request's first admission: the prefix-cache hit it got (what `RequestOutput.num_cached_tokens` and
    the usage's cached tokens report). Recorded only while someone reads them (`EngineCore.record_admissions`)."""

    req_id: str
    prompt_tokens: int
    cached_tokens: int
