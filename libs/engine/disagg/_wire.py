"""Wire <-> engine conversions, moved here verbatim from libs/engine/disagg.py.

Temporary: this is the one module of libs/engine that imports `protos`; the engine-worker base takes these
over (and this module goes away when the branches are merged).
"""

from __future__ import annotations

import math

from libs.engine.request import FinishReason, SamplingParams, TokenLogprob
from protos import messages as wire

LOGPROB_FLOOR = -9999.0


# ---------------------------------------------------------------------------------------------- wire <-> engine
def engine_params(p: wire.SamplingParams) -> SamplingParams:
    """Wire sampling params -> engine params (raises ValueError on values the engine refuses)."""
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                          seed=p.seed, stop_token_ids=tuple(p.stop_token_ids), stop=tuple(p.stop),
                          logprobs=p.logprobs if p.wants_logprobs else None, ignore_eos=p.ignore_eos)


def request_refusal(req: wire.GenerateRequest, vocab_size: int, max_request_tokens: int
                    ) -> tuple[wire.AckStatus, str] | None:
    """Why a worker of this model can never serve `req` (ack status + message), or None when it can (pure)."""
    if not req.token_ids:
        return wire.AckStatus.INVALID, "the prompt has no tokens"
    bad = [t for t in req.token_ids if not 0 <= t < vocab_size]
    if bad:
        return wire.AckStatus.INVALID, f"token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
    total = len(req.token_ids) + req.sampling.max_tokens
    if total > max_request_tokens:
        return wire.AckStatus.TOO_LARGE, (f"prompt ({len(req.token_ids)} tokens) + max_tokens "
                                          f"({req.sampling.max_tokens}) = {total} tokens exceeds this worker's "
                                          f"limit of {max_request_tokens}")
    try:
        engine_params(req.sampling)
    except ValueError as exc:
        return wire.AckStatus.INVALID, str(exc)
    return None


def wire_logprob(lp: TokenLogprob) -> wire.TokenLogprob:
    # JSON has no -inf: "impossible" alternatives get a floor value, as on the combined worker.
    def finite(x: float) -> float:
        return x if math.isfinite(x) else LOGPROB_FLOOR

    return wire.TokenLogprob(token_id=lp.token_id, logprob=finite(lp.logprob),
                             top={t: finite(v) for t, v in lp.top})


def wire_finish(reason: FinishReason | None) -> wire.FinishReason | None:
    if reason is None:
        return None
    return {FinishReason.STOP: wire.FinishReason.STOP, FinishReason.LENGTH: wire.FinishReason.LENGTH,
            FinishReason.ABORT: wire.FinishReason.ABORT}.get(reason, wire.FinishReason.ERROR)
