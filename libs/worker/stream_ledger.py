"""Numbered token streams a gateway can fetch again.

Core NATS delivers at most once, so a dead or hung NATS node can drop chunks silently. `StreamLedger`
numbers each request's chunks per sending instance (`TokenChunk.seq`, from 0 without gaps) and keeps the
last `keep_chunks` of each request while it runs and for `keep_s` after its final chunk, for at most
`max_requests` requests (the oldest finished go first). The gateway asks for what it missed
(`StreamReplayRequest`) on a gap or after a silent liveness interval (docs/reliability.md). Pure
bookkeeping on the service loop: no locks, no I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protos.messages import StreamReplayReply, TokenChunk


@dataclass
class _Stream:
    next_seq: int = 0
    chunks: deque[TokenChunk] = field(default_factory=deque)


class StreamLedger:
    def __init__(self, keep_chunks: int = 1024, keep_s: float = 60.0, max_requests: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if keep_chunks < 1 or max_requests < 1 or keep_s < 0:
            raise ValueError("keep_chunks and max_requests must be >= 1, keep_s >= 0")
        self.keep_chunks, self.keep_s, self.max_requests = keep_chunks, keep_s, max_requests
        self._clock = clock
        self._streams: OrderedDict[str, _Stream] = OrderedDict()  # in order of each stream's first chunk
        self._finished: OrderedDict[str, float] = OrderedDict()  # request id -> when it finished, oldest first
        self.replays = 0  # replay requests answered with at least one chunk (a chunk was lost in transit)

    def __len__(self) -> int:
        return len(self._streams)

    def number(self, chunk: TokenChunk) -> TokenChunk:
        """`chunk` with its `seq` set, kept for replay. A chunk for a request whose stream already finished
        starts a new stream (the same request id tried again)."""
        now = self._clock()
        stream = self._streams.get(chunk.request_id)
        if stream is None or chunk.request_id in self._finished:
            stream = self._streams[chunk.request_id] = _Stream(chunks=deque(maxlen=self.keep_chunks))
            self._streams.move_to_end(chunk.request_id)
            self._finished.pop(chunk.request_id, None)
        numbered = chunk.model_copy(update={"seq": stream.next_seq})
        stream.next_seq += 1
        stream.chunks.append(numbered)
        if numbered.finish_reason is not None:
            self._finished[chunk.request_id] = now
        self._prune(now)
        return numbered

    def replay(self, request_id: str, from_seq: int) -> StreamReplayReply:
        self._prune(self._clock())
        stream = self._streams.get(request_id)
        if stream is None:
            return StreamReplayReply(known=False)
        first_kept = stream.chunks[0].seq if stream.chunks else stream.next_seq
        chunks = [c for c in stream.chunks if c.seq >= from_seq]
        if chunks:
            self.replays += 1
        return StreamReplayReply(known=True, first_kept=first_kept, chunks=chunks)

    def _prune(self, now: float) -> None:
        """Drop finished streams older than keep_s; past max_requests, the oldest finished first, then the
        oldest (a gateway asking for it later is told the chunks are gone: an explicit error, not a hang).
        Amortised O(1) a call."""
        while self._finished:
            rid, at = next(iter(self._finished.items()))
            if now - at <= self.keep_s and len(self._streams) <= self.max_requests:
                break
            del self._finished[rid], self._streams[rid]
        while len(self._streams) > self.max_requests:
            rid, _ = self._streams.popitem(last=False)
            self._finished.pop(rid, None)
