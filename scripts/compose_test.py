"""`make compose-test`: build (cached), bring up a compose stack of its own, run the acceptance checks, tear down.

    python -m scripts.compose_test [--base-image IMAGE]

Checks: the openai client against the containerised gateway; greedy outputs equal `make run`'s; scaling
prefill / decode up and back down under streams loses no request that had not started streaming, and the
registry shows each change within its TTL; a SIGKILLed decode container is restarted and the stack serves
again. Every wait is bounded; a failed check raises ComposeError with what was seen. Everything it started
(stack, volumes, a dockerd) is removed again. Details: docs/deployment.md, "`make compose-test`".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.compose import (
    BASE_IMAGE,
    ROOT,
    ComposeError,
    Daemon,
    Stack,
    free_port,
    get_json,
    instances,
    prepared,
    provide_docker,
    run,
    say,
)

PROMPTS = ["The capital of France is", "windserve serves", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "Say hello to the containers."}]
GREEDY_TOKENS = 24
REGISTRY_TTL_S = 5.0  # WINDSERVE_REGISTRY_TTL_S default (libs/service/config.py)
CHANGE_BOUND_S = REGISTRY_TTL_S + 2.0  # TTL + the freshness slack (1 s) + the readiness cache / sweep (<= 1 s)
STREAMS = 24  # requests of the scale phase
STREAM_CONCURRENCY = 8  # clients: later requests start while the scale-down runs
STREAM_TOKENS = 48


def client(url: str, asynchronous: bool = False):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def wait_for(what: str, check, timeout_s: float, interval_s: float = 0.25):
    """Poll `check()` until it returns something truthy; ComposeError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise ComposeError(f"{what}: not within {timeout_s:.0f} s (last seen: {last!r})")


# ------------------------------------------------------------------------------ 1 + 2: API and greedy parity
def api_checks(url: str) -> str:
    """Completions, chat, and streams of both; returns the model id."""
    c = client(url)
    model = c.models.list().data[0].id
    comp = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    chat = c.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    streamed = "".join(ev.choices[0].text for ev in c.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True) if ev.choices)
    chat_streamed = "".join(ev.choices[0].delta.content or "" for ev in c.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, stream=True) if ev.choices)
    if not comp.choices[0].text or comp.usage is None or comp.usage.completion_tokens < 1:
        raise ComposeError(f"completion came back empty: {comp}")
    if not chat.choices[0].message.content:
        raise ComposeError(f"chat came back empty: {chat}")
    if streamed != comp.choices[0].text or chat_streamed != chat.choices[0].message.content:
        raise ComposeError(f"streams differ from the plain answers: {streamed!r} vs {comp.choices[0].text!r}, "
                           f"{chat_streamed!r} vs {chat.choices[0].message.content!r}")
    say(f"API: completion {comp.choices[0].text!r}, chat {chat.choices[0].message.content!r}, streams equal")
    return model


def greedy(url: str, model: str) -> list[str]:
    c = client(url)
    texts = [c.completions.create(model=model, prompt=p, max_tokens=GREEDY_TOKENS, temperature=0).choices[0].text
             for p in PROMPTS]
    texts.append(c.chat.completions.create(model=model, messages=CHAT, max_tokens=GREEDY_TOKENS,
                                           temperature=0).choices[0].message.content or "")
    return texts


@dataclass
class MakeRun:
    """`make run`'s topology (python -m scripts.run) on free ports with its run dir under /tmp."""

    proc: subprocess.Popen[bytes] | None = None
    url: str = ""

    def __enter__(self) -> MakeRun:
        self.tmp = tempfile.TemporaryDirectory(prefix="windserve-makerun-")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(self.tmp.name) / "run.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "scripts.run", "--http-port", str(port), "--run-dir", self.tmp.name,
                 "--ready-timeout", "180"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={k: v for k, v in os.environ.items() if not k.startswith("WINDSERVE_")})
        wait_for("make run ready", self._ready, 200, 0.5)
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise ComposeError(f"make run exited: {self.log.read_text()[-2000:]}")
        return b"windserve: ready" in self.log.read_bytes()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own group: the supervisor stops its children
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.tmp.cleanup()


def greedy_parity(stack: Stack, model: str) -> None:
    containerised = greedy(stack.url, model)
    with MakeRun() as local:
        native = greedy(local.url, model)
    if containerised != native:
        pairs = [(a, b) for a, b in zip(containerised, native, strict=True) if a != b]
        raise ComposeError(f"greedy outputs differ from make run's: {pairs}")
    say(f"greedy: {len(native)} outputs equal make run's (e.g. {native[0]!r})")


# ------------------------------------------------------------------------------ 3: scaling under load
@dataclass
class Outcome:
    sent: float
    first: float | None = None  # first token at the client
    done: float | None = None
    error: str = ""


async def stream(c, model: str, prompt: list[int], out: Outcome) -> None:
    try:
        s = await c.completions.create(model=model, prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
        tokens = 0
        async for ev in s:
            if ev.choices and ev.choices[0].text and out.first is None:
                out.first = time.monotonic()
            tokens += 1
        if tokens == 0:
            out.error = "empty stream"
    except Exception as exc:  # a lost request: recorded, judged below
        out.error = f"{type(exc).__name__}: {exc}"
    out.done = time.monotonic()


def counts(url: str) -> dict[str, int]:
    return {role: len(ids) for role, ids in instances(url).items()}


def registry_shows(url: str, want: dict[str, int]) -> float:
    """Seconds until /health lists `want` instances per role; ComposeError beyond CHANGE_BOUND_S."""
    start = time.monotonic()
    wait_for(f"registry shows {want}", lambda: all(counts(url).get(r) == n for r, n in want.items()) or None,
             CHANGE_BOUND_S, 0.1)
    return time.monotonic() - start


async def scale_under_load(stack: Stack, model: str) -> dict[str, float]:
    up = await asyncio.to_thread(stack.up, {"prefill": 2, "decode": 2}, 240, False)
    seen_up = await asyncio.to_thread(registry_shows, stack.url, {"prefill": 2, "decode": 2})
    say(f"scaled up to prefill=2 decode=2 in {up:.1f} s; registry showed it {seen_up:.1f} s later")
    c = client(stack.url, asynchronous=True)
    sem = asyncio.Semaphore(STREAM_CONCURRENCY)
    outcomes = [Outcome(0.0) for _ in range(STREAMS)]

    async def one(i: int) -> None:
        async with sem:
            outcomes[i].sent = time.monotonic()
            await stream(c, model, [(7 * i + k) % 250 for k in range(40 + i)], outcomes[i])

    tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
    async with asyncio.timeout(120):  # the first wave streams (or prefills) on both pairs
        while sum(o.first is not None for o in outcomes) < STREAM_CONCURRENCY // 2:
            await asyncio.sleep(0.05)
    scale_start = time.monotonic()
    down = await asyncio.to_thread(stack.up, {"prefill": 1, "decode": 1}, 240, False)
    seen_down = await asyncio.to_thread(registry_shows, stack.url, {"prefill": 1, "decode": 1})
    async with asyncio.timeout(300):
        await asyncio.gather(*tasks)
    lost = [o for o in outcomes if o.error and (o.first is None or o.first >= scale_start)]
    streaming_lost = [o for o in outcomes if o.error and o not in lost]
    if lost:
        raise ComposeError(f"{len(lost)} requests not yet streaming at the scale-down were lost: "
                           f"{[o.error for o in lost][:3]}")
    before = sum(1 for o in outcomes if o.first is not None and o.first < scale_start)
    in_flight = sum(1 for o in outcomes if o.sent and o.sent < scale_start and (o.done or 0) > scale_start)
    during = sum(1 for o in outcomes if scale_start <= (o.sent or scale_start) <= scale_start + down)
    say(f"scaled down to 1+1 in {down:.1f} s under {STREAMS} streams ({in_flight} in flight when it began, "
        f"{before} of them streaming; {during} sent while it ran): none lost that had not started streaming "
        f"({len(streaming_lost)} lost mid-stream); registry showed it {seen_down:.1f} s after the containers "
        "were gone")
    return {"scale_up_s": up, "scale_down_s": down, "registry_up_s": seen_up, "registry_down_s": seen_down}


# ------------------------------------------------------------------------------ 4: restart policy
def restart_after_kill(stack: Stack, model: str) -> float:
    (cid,) = stack.containers("decode")
    before = set(instances(stack.url).get("decode", []))
    pid = int(run(["docker", "inspect", "-f", "{{.State.Pid}}", cid], quiet=True).stdout.decode())
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # the container's main process dies (not `docker stop`/`kill`: no manual stop)

    def restarted() -> bool:
        out = run(["docker", "inspect", "-f", "{{.RestartCount}} {{.State.Running}}", cid], quiet=True).stdout
        count, running = out.decode().split()
        return int(count) >= 1 and running == "true"

    wait_for("decode container restarted by its policy", restarted, 60, 0.5)
    # the dead instance never deregistered: its entry must leave the registry by its TTL (docs/reliability.md)
    wait_for("the killed decode instance gone from the registry",
             lambda: not before & set(instances(stack.url).get("decode", [])),
             max(1.0, start + CHANGE_BOUND_S - time.monotonic()), 0.1)  # bound counted from the kill
    expired = time.monotonic() - start
    wait_for("a new decode instance registered",
             lambda: set(instances(stack.url).get("decode", [])) - before, 120, 0.5)
    wait_for("/health/ready 200 again", lambda: get_json(f"{stack.url}/health/ready")[0] == 200, 60, 0.5)
    text = client(stack.url).completions.create(model=model, prompt=PROMPTS[1], max_tokens=8,
                                                temperature=0).choices[0].text
    took = time.monotonic() - start
    say(f"killed decode's process: its registry entry expired after {expired:.1f} s, the container was "
        f"restarted by its policy, serving again after {took:.1f} s ({text!r})")
    return took


def acceptance(stack: Stack) -> dict[str, float]:
    timings = {"up_s": stack.up()}
    say(f"stack {stack.project} up in {timings['up_s']:.1f} s at {stack.url}: {counts(stack.url)}")
    model = api_checks(stack.url)
    start = time.monotonic()
    greedy_parity(stack, model)
    timings["greedy_parity_s"] = time.monotonic() - start
    timings |= asyncio.run(scale_under_load(stack, model))
    timings["restart_s"] = restart_after_kill(stack, model)
    return timings


def cmd_test(args: argparse.Namespace) -> int:
    start = time.monotonic()
    try:
        provided = provide_docker()
    except ComposeError as exc:
        if not args.when_able:
            raise
        say(f"skipped: this machine cannot provide Docker: {exc}")
        return 0
    with prepared(args.base_image, provided) as (compose, _daemon):
        built = time.monotonic() - start
        stack = Stack(compose, project=f"windserve-test-{os.getpid()}", http_port=free_port())
        try:
            timings = acceptance(stack)
        finally:
            stack.down()
            left = stack.leftovers()
        if left:
            raise ComposeError(f"left behind after down: {', '.join(left)}")
    timings = {"prepare_and_build_s": built, **timings, "total_s": time.monotonic() - start}
    say("PASS: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return 0


def cannot_run() -> str:
    """Why this machine cannot run the acceptance run at all, or ''."""
    if os.geteuid() == 0 or (shutil.which("docker") and Daemon.running()):
        return ""
    return "not root (apt-get, dockerd) and no Docker daemon answers"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.compose_test", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-image", default=os.environ.get("WINDSERVE_BASE_IMAGE", BASE_IMAGE))
    p.add_argument("--when-able", action="store_true", help="skip (exit 0, saying why) where it cannot run: "
                   "neither root (to install and start Docker) nor a Docker daemon answering, or Docker cannot be "
                   "installed or started here (the image build and the checks still fail loudly)")
    args = p.parse_args(argv)
    if args.when_able and (why := cannot_run()):
        print(f"compose-test: skipped: {why}", flush=True)
        return 0
    try:
        return cmd_test(args)
    except ComposeError as exc:
        print(f"compose-test: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
