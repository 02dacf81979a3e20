"""libs/transfer: KV transfer over real ucxx (loopback) and the plain-TCP fallback.

Every transfer test runs on both engines. Bounds on failure tests are far below the
configured layer timeout, so they only pass when the failure is signalled explicitly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from libs.transfer import (
    LayerSpec,
    PeerDisconnected,
    TransferAborted,
    TransferBackend,
    TransferConfig,
    TransferError,
    TransferHeader,
    TransferRejected,
    TransferState,
    TransferTimeout,
    create_engine,
    parse_address,
    select_backend,
)
from libs.transfer.frames import (
    FRAME_PREFIX,
    Abort,
    Accept,
    Cancel,
    Done,
    End,
    FrameError,
    FrameType,
    Header,
    Hello,
    HelloAck,
    Layer,
    Message,
    Reject,
    decode_frame,
    decode_prefix,
    encode_frame,
)
from libs.transfer.protocol import payload_tag
from libs.transfer.transfers import OutgoingTransfer

pytestmark = pytest.mark.timeout(60)

TCP_LO = (("TLS", "tcp,self"), ("NET_DEVICES", "lo"))
SM = (("TLS", "sm,self"),)
# Generous waits: a test that relies on them instead of an explicit signal fails its bound.
SLOW = dict(layer_timeout_s=30.0, accept_timeout_s=30.0, header_timeout_s=30.0)
BOUND_S = 5.0
BACKENDS = [TransferBackend.UCX, TransferBackend.TCP]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**kw) -> TransferConfig:
    base = dict(SLOW, register_grace_s=0.05, drain_timeout_s=1.0, ucx_options=TCP_LO)
    base.update(kw)
    return TransferConfig(**base)


@pytest.fixture(params=BACKENDS, ids=lambda b: b.value)
def backend(request) -> TransferBackend:
    return request.param


@pytest.fixture
async def pair(backend):
    """(receiver, sender) engines of one backend, started on loopback."""
    rx, tx = create_engine(_config(), backend), create_engine(_config(), backend)
    await rx.start()
    await tx.start()
    yield rx, tx
    await tx.close()
    await rx.close()


def _kv(seed: int, layers: list[tuple[str, int, str]], pages: int = 3, page: int = 4) -> tuple[list, list]:
    """Random KV-shaped layers (pages, page_size, kv_heads, head_dim) and their specs."""
    gen = torch.Generator().manual_seed(seed)
    tensors, specs = [], []
    for group, index, dtype in layers:
        heads = 2 if group == "full" else 4
        raw = torch.randint(-128, 127, (pages, page, heads, 8), generator=gen, dtype=torch.int32)
        if dtype in ("int8", "uint8", "int16"):
            t = raw.to(getattr(torch, dtype))
        else:
            t = (raw.float() / 7).to(getattr(torch, dtype))
        tensors.append(t)
        specs.append(LayerSpec(group, index, pages, dtype, tuple(t.shape)))
    return tensors, specs


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compare raw bytes (bfloat16/fp8 via uint8 view), so NaN payloads or -0.0 still count.
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


MIXED = [("full", 0, "bfloat16"), ("swa", 1, "float16"), ("swa", 2, "float32"), ("full", 5, "int8"),
         ("swa", 6, "float8_e4m3fn")]


# -- pure protocol -----------------------------------------------------------------------
@pytest.mark.unit
def test_layer_spec_bytes_and_validation():
    assert LayerSpec("swa", 3, 2, "bfloat16", (2, 16, 8, 320)).nbytes == 2 * 16 * 8 * 320 * 2
    assert LayerSpec("full", 0, 0, "float8_e4m3fn", (0, 16)).nbytes == 0
    with pytest.raises(ValueError, match="dtype"):
        LayerSpec("full", 0, 1, "complex64", (1,))
    with pytest.raises(ValueError, match="group"):
        LayerSpec("", 0, 1, "int8", (1,))
    header = TransferHeader("req-1", (LayerSpec("full", 0, 2, "int8", (2, 4)), LayerSpec("swa", 1, 1, "int16", (1, 4))))
    assert TransferHeader.from_wire(header.to_wire(seq=7)) == header
    assert header.total_bytes == 8 + 8


@pytest.mark.unit
def test_tags_are_deterministic_and_distinct():
    tags = {payload_tag(n, s, p) for n in (1, 2) for s in range(20) for p in range(64)}
    assert len(tags) == 2 * 20 * 64
    assert payload_tag(5, 6, 7) == payload_tag(5, 6, 7) < 2**64


@pytest.mark.unit
def test_frame_limits_addresses_and_backend_choice():
    with pytest.raises(FrameError, match="exceeds"):
        decode_prefix(bytes([3]) + (10**9).to_bytes(8, "big"), max_body=1024)
    with pytest.raises(FrameError, match="unknown frame type"):
        decode_prefix(bytes([99]) + (1).to_bytes(8, "big"), max_body=1024)
    assert parse_address("ucx://10.0.0.2:4000") == ("ucx", "10.0.0.2", 4000)
    with pytest.raises(ValueError, match="host:port"):
        parse_address("10.0.0.2:4000")
    assert select_backend("tcp") is TransferBackend.TCP
    assert select_backend("ucx") is TransferBackend.UCX
    with pytest.raises(ValueError, match="WINDSERVE_TRANSFER"):
        select_backend("rdma")
    assert TransferConfig(ucx_options=SM).endpoint_error_handling() is False
    assert TransferConfig(ucx_options=TCP_LO).endpoint_error_handling() is True
    with pytest.raises(ValueError, match="layer_timeout_s"):
        TransferConfig(layer_timeout_s=0)


@pytest.mark.unit
def test_ucx_context_options_default_tcp_segments_unless_env_or_config_says(monkeypatch):
    from libs.transfer.backends.ucx import ucx_context_options

    for name in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert ucx_context_options(()) == {"TCP_TX_SEG_SIZE": "256k", "TCP_RX_SEG_SIZE": "256k"}
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64k")  # the environment wins over the default: UCX reads it
    assert ucx_context_options((("TLS", "tcp,self"),)) == {"TCP_RX_SEG_SIZE": "256k", "TLS": "tcp,self"}
    assert ucx_context_options((("TCP_RX_SEG_SIZE", "1m"),)) == {"TCP_RX_SEG_SIZE": "1m"}  # config wins


def test_every_frame_round_trips_through_its_codec():
    header = TransferHeader("r", (LayerSpec("full", 0, 2, "int8", (2, 4)),))
    frames = [Hello(1, "ucx", "e1", 2**64 - 1, "d2FybQ=="), HelloAck(engine="e2"), HelloAck(error="nope"),
              Header(3, header), Accept(3), Reject(3, "why"), Layer(3, 0, 8), End(3), Done(3, 8), Abort(3, "stop"),
              Cancel(3, "gone"), Message(3, b"\x00opaque{"), Message(2**64 - 1, b"")]
    for frame in frames:
        raw = encode_frame(frame)
        ftype, length = decode_prefix(raw[:FRAME_PREFIX.size], max_body=1 << 20)
        assert (ftype, length) == (frame.TYPE, len(raw) - FRAME_PREFIX.size)
        assert decode_frame(ftype, raw[FRAME_PREFIX.size:]) == frame
    assert encode_frame(Done(3, 8)).endswith(b'{"seq":3,"bytes":8}')  # protocol v1 wire names kept


@pytest.mark.unit
@pytest.mark.parametrize(("ftype", "body", "message"), [
    (FrameType.ACCEPT, b"{}", "ACCEPT frame has no 'seq' field"),
    (FrameType.DONE, b'{"seq": 1, "bytes": "8"}', "DONE frame field 'bytes' must be int, got '8'"),
    (FrameType.END, b'{"seq": true}', "END frame field 'seq' must be int"),
    (FrameType.REJECT, b'{"seq": 1}', "REJECT frame has no 'reason' field"),
    (FrameType.HELLO, b'{"version": 1, "backend": "tcp", "engine": "e", "nonce": 1, "data": 5}',
     "HELLO frame field 'data' must be str | None"),
    (FrameType.CANCEL, b"[1, 2]", "CANCEL frame body must be an object, got list"),
    (FrameType.ABORT, b"{oops", "ABORT frame body is not JSON"),
    (FrameType.LAYER, b"short", "LAYER frame body must be 16 bytes, got 5"),
    (FrameType.MESSAGE, b"short", "MESSAGE frame body must hold at least 8 bytes, got 5"),
])
def test_malformed_frames_raise_a_clear_error(ftype, body, message):
    with pytest.raises(FrameError, match=message.replace("|", r"\|")) as info:
        decode_frame(ftype, body)
    assert info.value.ftype is ftype


@pytest.mark.unit
def test_malformed_header_error_keeps_the_seq_so_one_transfer_can_be_rejected():
    body = b'{"seq": 9, "request_id": "r", "layers": [["full", 0, 1, "complex64", [1]]]}'
    with pytest.raises(FrameError, match="HEADER frame of transfer 9: .*dtype") as info:
        decode_frame(FrameType.HEADER, body)
    assert (info.value.ftype, info.value.seq) == (FrameType.HEADER, 9)
    with pytest.raises(FrameError, match="HEADER frame has no 'seq'") as info:
        decode_frame(FrameType.HEADER, b'{"request_id": "r", "layers": []}')
    assert info.value.seq is None


# -- transfers on both engines -------------------------------------------------------------
@pytest.mark.integration
async def test_messages_go_both_ways_outside_transfers_and_a_drop_is_heard(pair):
    """MESSAGE frames (the GCache direct path's requests) reach the other engine's handler, in order, either
    way; when the connection drops every drop listener hears of it."""
    rx, tx = pair
    at_rx: list[tuple[int, bytes]] = []
    at_tx: list[tuple[int, bytes]] = []
    dropped: list[object] = []

    def answer(conn, msg_id, body):
        at_rx.append((msg_id, body))
        conn.post_message(msg_id, body.upper())

    rx.set_message_handler(answer)
    tx.set_message_handler(lambda conn, msg_id, body: at_tx.append((msg_id, body)))
    rx.add_drop_listener(lambda conn, err: dropped.append(err))
    conn = await tx.connect(rx.address)
    conn.post_message(5, b"ping")
    await conn.send_message(6, b"")
    conn.post_message(2**64 - 1, b"x" * 100_000)
    async with asyncio.timeout(10):
        while len(at_tx) < 3:
            await asyncio.sleep(0.01)
    assert at_rx == [(5, b"ping"), (6, b""), (2**64 - 1, b"x" * 100_000)]
    assert at_tx == [(5, b"PING"), (6, b""), (2**64 - 1, b"X" * 100_000)]
    await conn.drop(PeerDisconnected("test"))
    async with asyncio.timeout(10):
        while not dropped:
            await asyncio.sleep(0.01)
    assert isinstance(dropped[0], TransferError)
    with pytest.raises(PeerDisconnected):
        conn.post_message(7, b"late")


@pytest.mark.integration
async def test_round_trip_is_byte_exact_with_pages_and_accounting(pair):
    rx, tx = pair
    src, specs = _kv(0, MIXED)
    # Destinations: contiguous tensors for some layers, scattered page lists for the others.
    dests = [torch.empty_like(t) if i % 2 == 0 else [torch.empty_like(t[p]) for p in range(t.shape[0])]
             for i, t in enumerate(src)]
    inc = rx.expect("rt", dests)
    payloads = [t if i % 3 else list(t.unbind(0)) for i, t in enumerate(src)]  # some sent as page lists
    sent = await tx.send(rx.address, "rt", specs, payloads)
    got = await inc.wait(BOUND_S)
    for t, d in zip(src, dests, strict=True):
        assert _same_bytes(t, d if isinstance(d, torch.Tensor) else torch.stack(d))
    expected = sum(t.numel() * t.element_size() for t in src)
    assert sent.nbytes == got.nbytes == inc.bytes_received == expected
    assert tx.bytes_sent == rx.bytes_received == expected
    assert inc.state is TransferState.COMPLETE and got.layers == len(MIXED)


@pytest.mark.integration
async def test_allocator_callback_sees_header(pair):
    rx, tx = pair
    src, specs = _kv(1, [("full", 0, "bfloat16"), ("swa", 1, "bfloat16")], pages=2)
    seen = []

    def allocate(header: TransferHeader):
        seen.append(header)
        return [torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for s in header.layers]

    inc = rx.expect("alloc", allocate)
    await tx.send(rx.address, "alloc", specs, src)
    await inc.wait(BOUND_S)
    assert seen == [TransferHeader("alloc", tuple(specs))]
    for position, t in enumerate(src):
        assert _same_bytes(t, await inc.layer(position))


@pytest.mark.integration
async def test_layers_arrive_one_by_one_while_sender_still_computing(pair):
    rx, tx = pair
    src, specs = _kv(2, [("swa", i, "bfloat16") for i in range(4)])
    inc = rx.expect("lbl", [torch.empty_like(t) for t in src])
    arrived = [asyncio.Event() for _ in src]
    out = await tx.begin_send(rx.address, "lbl", specs)

    async def producer():
        for i, t in enumerate(src):
            await out.send_layer(t)
            await asyncio.wait_for(arrived[i].wait(), BOUND_S)  # "compute" the next layer only now
        return await out.finish()

    task = asyncio.ensure_future(producer())
    order = []
    async for position, dest in inc.layers(timeout=BOUND_S):
        # Layer i is usable while the transfer is still open and the sender is held before i+1.
        assert inc.state is TransferState.ACTIVE and inc.landed == position + 1
        assert out.next_position <= position + 1
        assert _same_bytes(src[position], dest)
        order.append(position)
        arrived[position].set()
    await task
    assert order == [0, 1, 2, 3]


@pytest.mark.integration
async def test_long_open_transfers_with_pauses_between_layers(backend):
    """Prefill streams each chunk's pages as the chunk finishes: begin_send once, then send_layer spread
    over time. Pauses longer than every per-call bound (layer, accept) must not kill the transfer, and
    two such transfers interleave on one connection."""
    bound = 0.2
    short = dict(layer_timeout_s=bound, accept_timeout_s=BOUND_S, header_timeout_s=BOUND_S)
    rx, tx = create_engine(_config(**short), backend), create_engine(_config(**short), backend)
    await rx.start()
    await tx.start()
    try:
        jobs = {}
        for n, rid in enumerate(("s1", "s2")):
            src, specs = _kv(20 + n, [("full", 0, "bfloat16"), ("swa", 1, "float16"), ("swa", 2, "int8")])
            dst = [torch.empty_like(t) for t in src]
            jobs[rid] = (src, dst, rx.expect(rid, dst))
        outs = {rid: await tx.begin_send(rx.address, rid, specs) for rid in jobs}
        await asyncio.sleep(2 * bound)  # the first chunk is still computing
        for position in range(3):
            for rid, (src, _, inc) in jobs.items():
                await outs[rid].send_layer(src[position])
                assert _same_bytes(src[position], await inc.layer(position, timeout=BOUND_S))
                await asyncio.sleep(1.5 * bound)
            assert all(o.state is TransferState.ACTIVE for o in outs.values())
        await asyncio.sleep(2 * bound)
        for rid, (src, dst, inc) in jobs.items():
            stats = await outs[rid].finish(timeout=BOUND_S)
            await inc.wait(BOUND_S)
            assert all(_same_bytes(s, d) for s, d in zip(src, dst, strict=True))
            assert stats.nbytes == sum(t.numel() * t.element_size() for t in src)
        assert len(tx._connections) == 1
    finally:
        await tx.close()
        await rx.close()


@pytest.mark.integration
async def test_malformed_header_rejects_that_transfer_and_keeps_the_connection(pair):
    rx, tx = pair
    conn = await tx.connect(rx.address)
    header = TransferHeader("broken", (LayerSpec("full", 0, 1, "int8", (1, 4)),))
    seq = conn.next_seq()
    out = OutgoingTransfer(header, conn, seq, layer_timeout_s=BOUND_S, drain_timeout_s=1.0)
    conn.outgoing[seq] = out
    body = b'{"seq": %d, "request_id": "broken", "layers": [["full", 0, 1, "complex64", [1]]]}' % seq
    conn.writer.write(FRAME_PREFIX.pack(FrameType.HEADER, len(body)) + body)  # a buggy peer's header
    with pytest.raises(TransferRejected, match="malformed header.*dtype"):
        await asyncio.wait_for(asyncio.shield(out.accept_fut), BOUND_S)
    src, specs = _kv(8, [("full", 0, "bfloat16")])
    inc = rx.expect("fine", [torch.empty_like(t) for t in src])
    await tx.send(rx.address, "fine", specs, src)
    await inc.wait(BOUND_S)
    assert not conn.closed and await tx.connect(rx.address) is conn


@pytest.mark.integration
async def test_malformed_control_frame_drops_the_connection_and_fails_its_transfers(pair):
    rx, tx = pair
    src, specs = _kv(9, [("full", 0, "bfloat16"), ("full", 1, "bfloat16")])
    inc = rx.expect("doomed", [torch.empty_like(t) for t in src])
    out = await tx.begin_send(rx.address, "doomed", specs)
    conn = await tx.connect(rx.address)
    conn.writer.write(FRAME_PREFIX.pack(FrameType.END, 2) + b"{}")  # END without a seq
    with pytest.raises(TransferError, match="protocol error.*END frame has no 'seq'"):
        await asyncio.wait_for(inc.wait(), BOUND_S)
    with pytest.raises(TransferError):
        await asyncio.wait_for(out.finish(), BOUND_S)


@pytest.mark.integration
async def test_concurrent_transfers_into_one_receiver(pair, backend):
    rx, tx = pair
    tx2 = create_engine(_config(), backend)
    await tx2.start()
    try:
        jobs = []
        for n, (engine, rid) in enumerate([(tx, "a"), (tx, "b"), (tx2, "c")]):
            src, specs = _kv(10 + n, [("full", 0, "bfloat16"), ("swa", 1, "float32"), ("swa", 2, "int8")])
            dst = [torch.empty_like(t) for t in src]
            jobs.append((src, dst, rx.expect(rid, dst), engine.send(rx.address, rid, specs, src)))
        await asyncio.gather(*(job[3] for job in jobs))
        for src, dst, inc, _ in jobs:
            await inc.wait(BOUND_S)
            assert all(_same_bytes(s, d) for s, d in zip(src, dst, strict=True))
        assert len(tx._connections) == 1  # both of tx's transfers shared one cached connection
    finally:
        await tx2.close()


@pytest.mark.integration
async def test_unknown_request_id_is_rejected(pair):
    rx, tx = pair
    _, specs = _kv(3, [("full", 0, "bfloat16")])
    with pytest.raises(TransferRejected, match="'ghost'"):
        await asyncio.wait_for(tx.begin_send(rx.address, "ghost", specs), BOUND_S)


@pytest.mark.integration
async def test_destination_mismatch_rejects_and_fails_both_sides(pair):
    rx, tx = pair
    src, specs = _kv(4, [("full", 0, "bfloat16")])
    inc = rx.expect("bad", [torch.empty(1, dtype=torch.bfloat16)])
    with pytest.raises(TransferRejected, match="bytes"):
        await asyncio.wait_for(tx.begin_send(rx.address, "bad", specs), BOUND_S)
    with pytest.raises(TransferRejected):
        await inc.wait(BOUND_S)


@pytest.mark.integration
async def test_sender_abort_fails_receiver_promptly(pair):
    rx, tx = pair
    src, specs = _kv(5, [("swa", i, "bfloat16") for i in range(3)])
    inc = rx.expect("abort-me", [torch.empty_like(t) for t in src])
    out = await tx.begin_send(rx.address, "abort-me", specs)
    await out.send_layer(src[0])
    assert _same_bytes(src[0], await inc.layer(0, timeout=BOUND_S))
    assert await tx.abort("abort-me", "client went away")
    with pytest.raises(TransferAborted, match="client went away"):
        await asyncio.wait_for(inc.wait(), BOUND_S)
    with pytest.raises(TransferAborted):
        await out.send_layer(src[1])
    # The connection survives an abort: the next request goes through.
    inc2 = rx.expect("after", [torch.empty_like(t) for t in src])
    await tx.send(rx.address, "after", specs, src)
    await inc2.wait(BOUND_S)


@pytest.mark.integration
async def test_receiver_timeout_cancels_the_sender(pair):
    rx, tx = pair
    src, specs = _kv(6, [("full", 0, "bfloat16"), ("full", 1, "bfloat16")])
    inc = rx.expect("slow", [torch.empty_like(t) for t in src])
    out = await tx.begin_send(rx.address, "slow", specs)
    with pytest.raises(TransferTimeout):
        await inc.wait(timeout=0.2)  # the sender never sends: receiver gives up, frees its pages
    for _ in range(250):  # CANCEL reaches the sender asynchronously (bounded poll, ~5 s)
        if out.state is TransferState.FAILED:
            break
        await asyncio.sleep(0.02)
    with pytest.raises(TransferAborted, match="did not happen"):
        await out.send_layer(src[0])
    assert out.state is TransferState.FAILED


@pytest.mark.integration
async def test_receiver_engine_closing_fails_the_sender(pair):
    rx, tx = pair
    src, specs = _kv(7, [("full", 0, "bfloat16"), ("full", 1, "bfloat16")])
    rx.expect("gone", [torch.empty_like(t) for t in src])
    out = await tx.begin_send(rx.address, "gone", specs)
    await rx.close()
    with pytest.raises(TransferError):
        await asyncio.wait_for(out.finish(), BOUND_S)  # send_layer/finish see the dead peer


# -- separate processes: killed peer, shared memory ------------------------------------------
SENDER = textwrap.dedent("""
    import asyncio, sys, torch
    sys.path.insert(0, {root!r})
    from libs.transfer import LayerSpec, TransferBackend, TransferConfig, create_engine

    async def main(backend, tls, address, rid, stall):
        opts = (("TLS", tls),) + ((("NET_DEVICES", "lo"),) if "tcp" in tls else ())
        engine = create_engine(TransferConfig(ucx_options=opts), TransferBackend(backend))
        await engine.start()
        torch.manual_seed(1234)
        src = [torch.randn(3, 4, 2, 8).to(torch.bfloat16) for _ in range(3)]
        specs = [LayerSpec("swa", i, 3, "bfloat16", tuple(t.shape)) for i, t in enumerate(src)]
        out = await engine.begin_send(address, rid, specs)
        await out.send_layer(src[0])
        print("SENT", flush=True)
        if stall == "stall":
            await asyncio.sleep(3600)
        for t in src[1:]:
            await out.send_layer(t)
        await out.finish()
        print("DONE", flush=True)
        await engine.close()

    asyncio.run(main(*sys.argv[1:]))
""").format(root=ROOT)


def _reference_layers() -> list[torch.Tensor]:
    torch.manual_seed(1234)
    return [torch.randn(3, 4, 2, 8).to(torch.bfloat16) for _ in range(3)]


def _spawn_sender(backend: TransferBackend, tls: str, address: str, rid: str, stall: str) -> subprocess.Popen:
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    return subprocess.Popen([sys.executable, "-c", SENDER, backend.value, tls, address, rid, stall],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


async def _read_line(proc: subprocess.Popen) -> str:
    return (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)).strip()


CROSS = [(TransferBackend.TCP, "tcp"), (TransferBackend.UCX, "tcp,self"), (TransferBackend.UCX, "sm,self")]


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "tls"), CROSS, ids=["tcp", "ucx-tcp", "ucx-sm"])
async def test_cross_process_transfer(kind, tls):
    opts = (("TLS", tls),) + ((("NET_DEVICES", "lo"),) if "tcp" in tls else ())
    rx = create_engine(_config(ucx_options=opts), kind)
    await rx.start()
    proc = _spawn_sender(kind, tls, rx.address, "xproc", "run")
    try:
        ref = _reference_layers()
        dst = [torch.empty_like(t) for t in ref]
        inc = rx.expect("xproc", dst)
        await inc.wait(30)
        assert all(_same_bytes(a, b) for a, b in zip(ref, dst, strict=True))
        assert await _read_line(proc) == "SENT"
        assert await _read_line(proc) == "DONE"
    finally:
        proc.kill()
        proc.wait(10)
        await rx.close()


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "tls"), CROSS, ids=["tcp", "ucx-tcp", "ucx-sm"])
async def test_killed_sender_process_fails_receiver_promptly(kind, tls):
    opts = (("TLS", tls),) + ((("NET_DEVICES", "lo"),) if "tcp" in tls else ())
    rx = create_engine(_config(ucx_options=opts), kind)
    await rx.start()
    proc = _spawn_sender(kind, tls, rx.address, "doomed", "stall")
    try:
        ref = _reference_layers()
        inc = rx.expect("doomed", [torch.empty_like(t) for t in ref])
        assert _same_bytes(ref[0], await inc.layer(0, timeout=30))
        assert await _read_line(proc) == "SENT"
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(PeerDisconnected):
            await asyncio.wait_for(inc.wait(), BOUND_S)
        if "sm" in tls:
            return  # shared memory cannot connect two workers of one process: no in-process sender
        # The receiver keeps serving: another (in-process) sender still gets through.
        tx = create_engine(_config(ucx_options=opts), kind)
        await tx.start()
        try:
            inc2 = rx.expect("next", [torch.empty_like(t) for t in ref])
            specs = [LayerSpec("swa", i, 3, "bfloat16", tuple(t.shape)) for i, t in enumerate(ref)]
            await tx.send(rx.address, "next", specs, ref)
            await inc2.wait(BOUND_S)
        finally:
            await tx.close()
    finally:
        proc.kill()
        proc.wait(10)
        await rx.close()
