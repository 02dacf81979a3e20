"""Wire (protos) <-> engine conversions of the engine roles (pure). The engine itself never imports protos."""

from __future__ import annotations

import base64
import math

import torch

from libs.engine.core import EngineLoad
from libs.engine.grammar import validate_spec
from libs.engine.mtp import FirstDrafts
from libs.engine.request import FinishReason, GrammarSpec, RequestOutput, SamplingParams, TokenLogprob
from libs.mm.placeholders import MM_TOKEN_FLAG
from libs.mm.wire import dtype_name, torch_dtype
from libs.worker.mm import mm_refusal
from protos import messages as wire

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: "impossible" alternatives get this value


def engine_params(p: wire.WireSamplingParams) -> SamplingParams:
    """Wire sampling params -> engine params (raises ValueError on values the engine refuses, a grammar that
    does not compile included: GrammarError is a ValueError)."""
    grammar = None
    if p.grammar is not None:
        grammar = GrammarSpec(p.grammar.kind, p.grammar.json_schema, p.grammar.parallel, p.grammar.reasoning)
        validate_spec(grammar)
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                          seed=p.seed, stop_token_ids=tuple(p.stop_token_ids), stop=tuple(p.stop),
                          logprobs=p.logprobs if p.wants_logprobs else None, ignore_eos=p.ignore_eos,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty, min_p=p.min_p,
                          logit_bias=tuple(p.logit_bias.items()), grammar=grammar)


def request_refusal(req: wire.GenerateRequest, vocab_size: int, max_request_tokens: int, has_vision: bool = False
                    ) -> tuple[wire.AckStatus, str] | None:
    """Why a worker of this model can never serve `req` (ack status + message), or None when it can. Ids beyond
    the vocabulary are allowed only as the pseudo tokens of `req.mm_items` (images, #16)."""
    if not req.token_ids:
        return wire.AckStatus.INVALID, "the prompt has no tokens"
    mm = mm_refusal(req.token_ids, req.mm_items, has_vision)
    if mm is not None:
        return wire.AckStatus.INVALID, mm
    bad = [t for t in req.token_ids if not 0 <= t < vocab_size and not (req.mm_items and t >= MM_TOKEN_FLAG)]
    bad += [t for t in req.resume_token_ids if not 0 <= t < vocab_size]
    if bad:
        return wire.AckStatus.INVALID, f"token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
    if len(req.resume_token_ids) >= req.sampling.max_tokens:
        return wire.AckStatus.INVALID, (f"{len(req.resume_token_ids)} resumed tokens leave nothing of max_tokens="
                                        f"{req.sampling.max_tokens} to generate")
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


def wire_logprob(lp: TokenLogprob) -> wire.WireTokenLogprob:
    def finite(x: float) -> float:
        return x if math.isfinite(x) else LOGPROB_FLOOR

    return wire.WireTokenLogprob(token_id=lp.token_id, logprob=finite(lp.logprob),
                             top={t: finite(v) for t, v in lp.top})


def wire_hidden(first: FirstDrafts) -> wire.WireHidden | None:
    """MTP in prefill: the hidden rows shipped with kv_commit (raw bytes, base64), None when there are none."""
    if first.hidden is None:
        return None
    rows = first.hidden.detach().to("cpu").contiguous()
    try:
        name = dtype_name(rows.dtype)
    except ValueError:  # another activation dtype: sent as float32, the decode engine converts back
        rows, name = rows.float(), "float32"
    return wire.WireHidden(first_position=first.hidden_from, rows=rows.shape[0], dtype=name,  # type: ignore[arg-type]
                           data_b64=base64.b64encode(rows.view(torch.uint8).numpy().tobytes()).decode())


def engine_first_drafts(msg: wire.KVCommitRequest) -> FirstDrafts | None:
    """kv_commit's drafts and hidden rows -> FirstDrafts (the decode engine checks them against its model), None
    without drafts or when the rows do not decode (the first step then decodes one token, as without them)."""
    if not msg.drafts:
        return None
    h = msg.draft_hidden
    if h is None:
        return FirstDrafts(tuple(msg.drafts), 0, None)
    try:
        raw = bytearray(base64.b64decode(h.data_b64, validate=True))
        dtype = torch_dtype(h.dtype)
        if not raw or len(raw) % (h.rows * dtype.itemsize):
            return None
        rows = torch.frombuffer(raw, dtype=dtype).reshape(h.rows, -1)
    except (ValueError, RuntimeError):
        return None
    return FirstDrafts(tuple(msg.drafts), h.first_position, rows)


def wire_finish(reason: FinishReason | None) -> wire.WireFinishReason | None:
    if reason is None:
        return None
    return {FinishReason.STOP: wire.WireFinishReason.STOP, FinishReason.LENGTH: wire.WireFinishReason.LENGTH,
            FinishReason.ABORT: wire.WireFinishReason.ABORT}.get(reason, wire.WireFinishReason.ERROR)


def chunk_from_output(out: RequestOutput, instance_id: str, prompt_tokens: int,
                      completion_tokens: int) -> wire.TokenChunk:
    """One engine output -> one TokenChunk; `completion_tokens` counts every token produced so far."""
    finished = out.finished and out.finish_reason is not None
    return wire.TokenChunk(
        request_id=out.req_id,
        token_ids=list(out.new_token_ids),
        logprobs=[wire_logprob(lp) for lp in out.logprobs or ()],
        finish_reason=wire_finish(out.finish_reason) if finished else None,
        usage=wire.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         cached_tokens=out.num_cached_tokens) if finished else None,
        instance_id=instance_id,
    )


def load_from(load: EngineLoad, now: float) -> wire.WorkerLoad:
    """Registry load snapshot from the engine's load (pool usage and queue lengths)."""
    usage, arena = load.usage, load.usage.arena
    return wire.WorkerLoad(
        running=load.running, waiting=load.waiting,
        kv_full_used=usage.full.in_use, kv_full_total=usage.full.capacity,
        kv_swa_used=usage.swa.in_use, kv_swa_total=usage.swa.capacity,
        kv_units_used=arena.full_in_use + arena.swa_in_use + arena.reserved if arena is not None else 0,
        kv_units_total=arena.units if arena is not None else 0,
        updated_at=now, arrivals=load.arrivals,
    )
