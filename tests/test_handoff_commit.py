"""kv_commit across a lost message (a NATS node died with the request or its reply on it): prefill asks again,
decode answers a repeat of a commit it took as it answered the first. The handlers' commit logic alone (the
whole path across a NATS node's death: tests/test_faults.py)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from protos.messages import KVCommitReply, KVCommitRequest
from services.decode.handlers import DecodeWorker, PrepareRefused
from services.prefill import handlers as prefill_handlers
from services.prefill.handlers import PrefillWorker


async def test_prefill_asks_kv_commit_again_when_an_ask_goes_unanswered(monkeypatch):
    monkeypatch.setattr(prefill_handlers, "COMMIT_ATTEMPT_S", 0.2)
    asks: list[KVCommitRequest] = []

    async def commit(decode: str, msg: KVCommitRequest) -> KVCommitReply:
        asks.append(msg)
        if len(asks) == 1:
            await asyncio.sleep(3600)  # the first ask (or its reply) was lost
        return KVCommitReply(request_id=msg.request_id)

    worker = PrefillWorker.__new__(PrefillWorker)
    worker.commit, worker.prepare_timeout_s, worker.unreachable_grace_s = commit, 5.0, 1.5
    msg = KVCommitRequest(request_id="r", first_token_id=7)
    async with asyncio.timeout(3):
        await worker._commit_asking_again("decode-0", msg)
    assert asks == [msg, msg]

    async def never(decode: str, msg: KVCommitRequest) -> KVCommitReply:
        await asyncio.sleep(3600)
        raise AssertionError

    worker.commit, worker.prepare_timeout_s = never, 0.5
    with pytest.raises(TimeoutError):  # the whole bound still holds
        async with asyncio.timeout(3):
            await worker._commit_asking_again("decode-0", msg)


async def test_decode_answers_a_repeated_commit_as_the_first_and_refuses_another():
    worker = DecodeWorker.__new__(DecodeWorker)
    loop = asyncio.get_running_loop()
    worker._commits, worker._taken, worker.tasks = {"r": loop.create_future()}, collections.OrderedDict(), {}
    first = KVCommitRequest(request_id="r", first_token_id=7)
    assert (await worker.commit(first)).request_id == "r"
    assert worker._commits["r"].result() == first
    worker._commits.pop("r")  # the hand-off closed (the request may already have finished)
    assert (await worker.commit(first)).request_id == "r"  # the repeat: answered, nothing else changes
    with pytest.raises(PrepareRefused):  # a different commit for it is still refused
        await worker.commit(KVCommitRequest(request_id="r", first_token_id=8))
    with pytest.raises(PrepareRefused):
        await worker.commit(KVCommitRequest(request_id="other", first_token_id=1))
