"""Request traces for cluster benchmarks (importable): the recorded conversation trace expanded to tokens, and
a generated agentic trace.

    conversation(n)  first n requests of ../shared/traces/conversation_trace.jsonl; each 512-token hash id
                     becomes 512 tokens drawn from a generator seeded by the id (equal ids, equal tokens)
    agentic(n)       about n requests of multi-turn agent sessions: shared system prompts, follow-ups that
                     repeat the whole earlier prompt AND output, forks from an earlier turn, retries
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

_NAME = Path("shared") / "traces" / "conversation_trace.jsonl"
# ../shared beside the checkout (a worktree may sit one level deeper: the first ancestor that has it)
TRACE = next((p / _NAME for p in Path(__file__).resolve().parents if (p / _NAME).exists()),
             Path(__file__).resolve().parents[2] / _NAME)
BLOCK = 512
VOCAB = 150_000


@dataclass(frozen=True)
class Request:
    t: float  # arrival, seconds
    prompt: tuple[int, ...]
    output: tuple[int, ...]


@lru_cache(maxsize=1 << 16)
def _segment(seed: int, n: int = BLOCK) -> tuple[int, ...]:
    """n deterministic tokens seeded by `seed` (numpy PCG64: same on every machine)."""
    return tuple(np.random.default_rng(seed).integers(0, VOCAB, n).tolist())


def trace_rows(n: int, path: Path = TRACE) -> Iterator[dict]:
    """The first `n` rows of the trace (timestamp ms, hash_ids of 512-token blocks, input / output lengths);
    each benchmark expands the block ids into tokens its own way."""
    with path.open() as f:
        for line in itertools.islice(f, n):
            yield json.loads(line)


def conversation(n: int, path: Path = TRACE) -> list[Request]:
    out = []
    for i, row in enumerate(trace_rows(n, path)):
        toks: list[int] = []
        for b in row["hash_ids"]:
            toks.extend(_segment(b))
        out.append(Request(row["timestamp"] / 1000.0, tuple(toks[:row["input_length"]]),
                           _segment(1 << 40 | i, row["output_length"])))
    return out


def agentic(n: int, seed: int = 7, rate_sessions_s: float = 1.0) -> list[Request]:
    """Sessions arrive as a Poisson process; each is a system prompt (one of 4 shared, 2-6K tokens) + a task,
    then 2-9 turns: every turn's prompt is the previous prompt + its output + a tool result (200-3000
    tokens), sent when the previous output would be done (25 ms/token) plus 1-4 s of tool time. 10% of
    turns are retried (the same prompt again 0.5 s later, a new output that the session continues from);
    10% of sessions fork from a random turn of an earlier session (same prefix, own continuation)."""
    rng = random.Random(seed)
    systems = [_segment(2 << 40 | k, rng.randint(2000, 6000)) for k in range(4)]
    seg = [0]

    def fresh(k: int) -> tuple[int, ...]:
        seg[0] += 1
        return _segment(3 << 40 | seg[0], k)

    reqs: list[Request] = []
    prefixes: list[tuple[int, ...]] = []  # prompt + output of earlier turns (fork points)
    t = 0.0
    while len(reqs) < n:
        t += rng.expovariate(rate_sessions_s)
        if prefixes and rng.random() < 0.1:
            prompt = rng.choice(prefixes) + fresh(rng.randint(100, 800))
        else:
            prompt = rng.choice(systems) + fresh(rng.randint(200, 2000))
        now = t
        for _ in range(rng.randint(2, 9)):
            out = fresh(rng.randint(100, 800))
            reqs.append(Request(now, prompt, out))
            if rng.random() < 0.1:  # retry: same prompt, another output; the session goes on from that one
                now += 0.5
                out = fresh(len(out))
                reqs.append(Request(now, prompt, out))
            prefixes.append(prompt + out)
            now += len(out) * 0.025 + rng.uniform(1.0, 4.0)
            prompt = prompt + out + fresh(rng.randint(200, 3000))
            if len(prompt) > 120_000:
                break
    reqs.sort(key=lambda r: r.t)
    return reqs[:n]
