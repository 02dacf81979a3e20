"""Request-side types shared by the scheduler, the runner and the services.

Pure: no torch. A `Request` is what a caller submits; a `RequestOutput` is what one
engine step hands back per request (the tokens produced in that step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # torch-free at run time: only services with images attach rows
    from libs.engine.mm import MMEmbeddings


class FinishReason(StrEnum):
    """Why a request stopped producing tokens."""

    STOP = "stop"  # a stop token or stop string was produced
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller
    PREFILLED = "prefilled"  # prefill-only request: first token produced, KV held until release()


@dataclass(frozen=True)
class GrammarSpec:
    """What a constrained request's output must match (compiled by libs.engine.grammar, cached by a hash of
    this spec). kind: "json_object" (any JSON object), "json_schema" (`schema`: a JSON schema as JSON text) or
    "tool_calls" (`schema`: the JSON schema of one call object {"name", "arguments"}; the output is
    `<tool_call>\n{call}\n</tool_call>`, one call, or one or more separated by newlines when `parallel`) or
    "structural_tag" (`schema`: an xgrammar structural tag as JSON text: tool calls of other formats, and
    tool_choice auto, where free text may turn into a call that must then be complete and valid).
    reasoning: a reasoning model's chat, where the constraint applies after `<think>…</think>`: "open" (the
    prompt opened it: any text up to `</think>` comes first), "detect" (the output may open one first), "" (none)."""

    kind: str
    schema: str = ""
    parallel: bool = False
    reasoning: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"GrammarSpec.kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if self.kind != "json_object" and not self.schema:
            raise ValueError(f"GrammarSpec of kind {self.kind!r} needs a schema")
        if self.reasoning not in ("", "open", "detect"):
            raise ValueError(f"GrammarSpec.reasoning must be '', 'open' or 'detect', got {self.reasoning!r}")


GRAMMAR_KINDS = ("json_object", "json_schema", "tool_calls", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature == 0 (or top_k == 1) means greedy. `seed` makes sampling reproducible per request
    (its own generator); without a seed the engine-wide generator is used. `logprobs`: None = no
    logprobs, k >= 0 = the sampled token's logprob plus the top-k alternatives.

    Logit processing, in this order (each row only when it asks): logit_bias (token id, bias) added;
    presence/frequency penalties over the output tokens (OpenAI: logit -= frequency * count + presence *
    [count > 0]); repetition_penalty over prompt + output tokens (CTRL/vLLM: a seen token's positive logit
    divided by it, a negative one multiplied); the grammar's token mask; then temperature, min_p (drop
    tokens whose probability is below min_p times the top one's), top-k, top-p.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
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
        self._check_processing()

    def _check_processing(self) -> None:
        if not self.repetition_penalty > 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if any(t < 0 for t, _ in self.logit_bias):
            raise ValueError("SamplingParams.logit_bias: token ids must be >= 0")
        if self.grammar is not None and self.ignore_eos:
            # a finished grammar allows only the end-of-sequence token: ignoring it would leave nothing to sample
            raise ValueError("SamplingParams: ignore_eos cannot be combined with a grammar")

    @property
    def penalized(self) -> bool:
        """Needs the sequence's tokens (presence / frequency / repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy without logprobs or logit processing: the token is the argmax and nothing else is computed."""
        return self.logprobs is None and self.greedy and self.grammar is None and not self.adjusts_logits


@dataclass
class Request:
    """One generation request. `prompt_token_ids` must be non-empty.

    prefill_only: stop after the first token and keep the KV pages until `EngineCore.release()`
    (used by a disaggregated prefill worker that ships the KV to a decode worker).
    on_progress: called on the engine thread after every step that computed some of this request's KV
    (once that step is committed), with a `PrefillProgress`. It runs inside the step loop: it must be quick
    and must not raise (the engine logs and aborts the request if it does).
    mm: the embedding rows of the prompt's images (libs/engine/mm.py) when `prompt_token_ids` carries pseudo
    tokens (the hash view, libs/mm/placeholders.py); kept for the request's life (a preempted request recomputes).
    resumed: output tokens the request generated before it came here (a stream migrated off a failed worker,
    docs/faults.md). They are computed with the prompt, as a preempted request's are, count as output (max_tokens,
    stop conditions, penalties, the grammar) and are never emitted again.
    """

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    prefill_only: bool = False
    on_progress: Callable[[PrefillProgress], None] | None = field(default=None, repr=False, compare=False)
    mm: MMEmbeddings | None = field(default=None, repr=False, compare=False)
    resumed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.resumed = [int(t) for t in self.resumed]
        if len(self.resumed) >= self.params.max_tokens:
            raise ValueError(f"request {self.req_id!r}: {len(self.resumed)} resumed tokens leave nothing of "
                             f"max_tokens={self.params.max_tokens} to generate")
        if not self.req_id:
            raise ValueError("Request.req_id must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r}: prompt_token_ids is empty")

    @property
    def start_token_ids(self) -> list[int]:
        """The tokens whose KV the request starts from: the prompt, then the resumed output (a new list)."""
        return [*self.prompt_token_ids, *self.resumed]


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
