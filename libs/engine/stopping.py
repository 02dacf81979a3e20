"""Stop conditions (pure): stop tokens, EOS, stop strings, max tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from libs.engine.request import FinishReason, SamplingParams

# Each token decodes to at least one character for the byte-level / BPE tokenizers we serve, so
# decoding the last (longest stop string + slack) tokens is enough to see any stop string that the
# newest token completed. The slack covers multi-byte characters split over several byte tokens.
_TAIL_SLACK_TOKENS = 8


def check_stop(token_ids: Sequence[int], num_prompt: int, params: SamplingParams, eos_token_ids: Sequence[int],
               decode: Callable[[list[int]], str] | None) -> FinishReason | None:
    """Decide whether the newest token (token_ids[-1]) finishes the request; token_ids = prompt (the first
    num_prompt) + output.

    Called after every appended token, so only stops completed by the newest token can be new. It reads
    only the tail: a call costs the same at output token 10 and at 100K.
    """
    last = token_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
        return FinishReason.STOP
    if params.stop:
        if decode is None:
            raise ValueError("stop strings need a tokenizer (EngineCore was built without one)")
        tail_len = max(len(s) for s in params.stop) + _TAIL_SLACK_TOKENS
        text = decode(list(token_ids[max(num_prompt, len(token_ids) - tail_len):]))
        if any(s in text for s in params.stop):
            return FinishReason.STOP
    if len(token_ids) - num_prompt >= params.max_tokens:
        return FinishReason.LENGTH
    return None
