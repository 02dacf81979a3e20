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
    Backend,
    LayerSpec,
    PeerDisconnected,
    TransferAborted,
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
from libs.transfer.protocol import ProtocolError, decode_prefix, payload_tag

pytestmark = pytest.mark.timeout(60)

TCP_LO = (("TLS", "tcp,self"), ("NET_DEVICES", "lo"))
SM = (("TLS", "sm,self"),)
# Generous waits: a test that relies on them instead of an explicit signal fails its bound.
SLOW = dict(layer_timeout_s=30.0, accept_timeout_s=30.0, header_timeout_s=30.0)
BOUND_S = 5.0
BACKENDS = [Backend.UCX, Backend.TCP]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**kw) -> TransferConfig:
    base = dict(SLOW, register_grace_s=0.05, drain_timeout_s=1.0, ucx_options=TCP_LO)
    base.update(kw)
    return TransferConfig(**base)


@pytest.fixture(params=BACKENDS, ids=lambda b: b.value)
def backend(request) -> Backend:
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
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_prefix(bytes([3]) + (10**9).to_bytes(8, "big"), max_body=1024)
    with pytest.raises(ProtocolError, match="unknown frame type"):
        decode_prefix(bytes([99]) + (1).to_bytes(8, "big"), max_body=1024)
    assert parse_address("ucx://10.0.0.2:4000") == ("ucx", "10.0.0.2", 4000)
    with pytest.raises(ValueError, match="host:port"):
        parse_address("10.0.0.2:4000")
    assert select_backend("tcp") is Backend.TCP
    assert select_backend("ucx") is Backend.UCX
    with pytest.raises(ValueError, match="WINDSERVE_TRANSFER"):
        select_backend("rdma")
    assert TransferConfig(ucx_options=SM).endpoint_error_handling() is False
    assert TransferConfig(ucx_options=TCP_LO).endpoint_error_handling() is True
    with pytest.raises(ValueError, match="layer_timeout_s"):
        TransferConfig(layer_timeout_s=0)


# -- transfers on both engines -------------------------------------------------------------
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
    from libs.transfer import Backend, LayerSpec, TransferConfig, create_engine

    async def main(backend, tls, address, rid, stall):
        opts = (("TLS", tls),) + ((("NET_DEVICES", "lo"),) if "tcp" in tls else ())
        engine = create_engine(TransferConfig(ucx_options=opts), Backend(backend))
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


def _spawn_sender(backend: Backend, tls: str, address: str, rid: str, stall: str) -> subprocess.Popen:
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    return subprocess.Popen([sys.executable, "-c", SENDER, backend.value, tls, address, rid, stall],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


async def _read_line(proc: subprocess.Popen) -> str:
    return (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)).strip()


CROSS = [(Backend.TCP, "tcp"), (Backend.UCX, "tcp,self"), (Backend.UCX, "sm,self")]


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
