"""Service base: bus + registry + health + metrics + graceful shutdown.

Lifecycle (ServiceState): STARTING → RUNNING → DRAINING → STOPPED.
Shutdown order and why:
1. stop accepting (unsubscribe every served subject) and deregister, so no peer picks us again;
2. drain in-flight handlers for up to `drain_timeout_s`, then cancel the rest;
3. `teardown()` hook, background tasks cancelled, bus drained and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

from libs.bus import Bus, BusConfig, BusError, HeartbeatConfig, Registration, Registry
from libs.service.config import ConfigError, ServiceConfig, load_config
from libs.service.logs import setup_logging
from libs.service.metrics import BACKGROUND_FAILURES, SERVICE_INFO, SERVICE_STATE, MetricsServer
from libs.service.selfcheck import EXIT_CODE as SELF_CHECK_EXIT
from libs.service.selfcheck import BusSelfCheck
from libs.service.watchdog import EXIT_CODE, LoopWatchdog
from protos import subjects
from protos.messages import HealthReply, HealthRequest, RegistryEntry, Role, ServiceState

log = logging.getLogger("windserve.service")


class Service:
    """Base of every windserve service. Subclasses set `role` and override the hooks."""

    role: ClassVar[Role]

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.state = ServiceState.STARTING
        self.bus: Bus | None = None
        self.registry: Registry | None = None
        self.metrics_server: MetricsServer | None = None
        self._registration: Registration | None = None
        self._watchdog: LoopWatchdog | None = None
        self.self_check: BusSelfCheck | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_requested = asyncio.Event()
        self._started_at = time.time()
        self._frozen_objects = 0  # objects freeze_heap moved to the permanent generation (health details)
        self._stopped = False
        self.exit_code = 0  # the process's, once `run()` returns (`fail`)

    # --- hooks for subclasses -------------------------------------------------------------

    async def setup(self) -> None:
        """Serve handlers / start servers. Bus and registry are ready when this runs."""

    async def teardown(self) -> None:
        """Release what setup() acquired (called after in-flight work drained)."""

    def health_details(self) -> dict[str, str]:
        return {}

    def registry_entry(self) -> RegistryEntry:
        metrics_url = self.metrics_server.url if self.metrics_server else ""
        return RegistryEntry(
            role=self.role,
            instance_id=self.config.instance_id,
            address=self.config.data_address,
            capacity=self.config.capacity,
            labels=self.config.labels,
            metrics_url=metrics_url,
            started_at=self._started_at,
        )

    # --- lifecycle --------------------------------------------------------------------------

    def _set_state(self, state: ServiceState) -> None:
        self.state = state
        for s in ServiceState:
            SERVICE_STATE.labels(s.value).set(1 if s == state else 0)
        log.info("state", extra={"state": state.value})

    async def start(self) -> None:
        cfg = self.config
        SERVICE_INFO.info({"role": self.role.value, "instance": cfg.instance_id})
        self._set_state(ServiceState.STARTING)
        if cfg.metrics_port:
            self.metrics_server = MetricsServer(cfg.metrics_host, cfg.metrics_port)
        self.bus = await Bus.connect(
            cfg.nats_url,
            name=f"{self.role.value}-{cfg.instance_id}",
            timeout=cfg.connect_timeout_s,
            config=BusConfig(connect_timeout_s=cfg.connect_timeout_s, drain_timeout_s=cfg.drain_timeout_s,
                             payload_replicas=cfg.nats_replicas),
        )
        self.registry = await Registry.open(self.bus, bucket=subjects.registry_bucket(cfg.namespace),
                                            replicas=cfg.nats_replicas)
        await self.bus.serve(subjects.health(cfg.namespace, cfg.instance_id), HealthRequest, self._health)
        await self.setup()
        heartbeat = HeartbeatConfig(ttl_s=cfg.registry_ttl_s, interval_s=cfg.heartbeat_interval_s)
        self._registration = self.registry.register(self.registry_entry(), heartbeat)
        await self._registration.start()
        self._set_state(ServiceState.RUNNING)

    def registry_outages(self) -> list[tuple[float, float | None]]:
        """When this instance's heartbeats could not be written (`Registration.unwritable`): a `RegistryView`
        of this process does not count that time against other entries' ages."""
        return self._registration.unwritable() if self._registration is not None else []

    def refresh_registration(self) -> None:
        """Re-read `registry_entry()` (e.g. fresh load figures); the next heartbeat publishes it."""
        if self._registration is not None:
            self._registration.entry = self.registry_entry()

    async def _health(self, _: HealthRequest) -> HealthReply:
        return HealthReply(
            role=self.role,
            instance_id=self.config.instance_id,
            state=self.state,
            uptime_s=round(time.time() - self._started_at, 3),
            in_flight=max(0, (self.bus.in_flight if self.bus else 0) - 1),  # minus this health request
            details={**self.health_details(), "gc_frozen_objects": str(self._frozen_objects)},
        )

    def request_stop(self) -> None:
        self._stop_requested.set()

    def fail(self, reason: str, exit_code: int = EXIT_CODE) -> None:
        """This instance cannot serve any more: stop (deregistered first, as any stop) and let the process exit
        with `exit_code`, so its restart policy restarts it."""
        log.critical("instance failed; stopping", extra={"error": reason, "exit_code": exit_code})
        self.exit_code = exit_code
        self.request_stop()

    async def stop(self) -> None:
        """Graceful, idempotent shutdown (see module docstring for the order)."""
        if self._stopped:
            return
        self._stopped = True
        self._set_state(ServiceState.DRAINING)
        if self.bus is not None:
            await self.bus.stop_serving()
        if self._registration is not None:
            await self._registration.stop(deregister=True)
        if self.bus is not None:
            await self.bus.drain_handlers(self.config.drain_timeout_s)
        try:
            await self.teardown()
        except Exception:
            log.exception("teardown failed")
        await self._cancel_background()
        if self.bus is not None:
            await self.bus.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self._watchdog is not None:  # last: a shutdown that stalls the loop still ends the process
            await self._watchdog.stop()
        self._set_state(ServiceState.STOPPED)

    async def run(self, watchdog: bool = False, self_check: bool | None = None) -> None:
        """Start, wait for SIGTERM/SIGINT (or request_stop), then stop gracefully. `watchdog` (the process entry
        point's, not a test's loop): from RUNNING on, a loop stalled for `loop_watchdog_s` ends the process.
        `self_check` (default: as `watchdog`): own health subject unanswered over the bus for `self_check_s` while
        connected stops the service with exit code 69 (libs/service/selfcheck.py)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            if watchdog and self.config.gc_freeze:
                self._frozen_objects = freeze_heap()
            if watchdog and self.config.loop_watchdog_s > 0:
                self._watchdog = LoopWatchdog(self.config.loop_watchdog_s,
                                              f"{self.role.value}-{self.config.instance_id}")
                self._watchdog.start()
            if (watchdog if self_check is None else self_check) and self.config.self_check_s > 0:
                self.start_self_check()
            log.info("ready", extra={"role": self.role.value, "instance": self.config.instance_id})
            await self._stop_requested.wait()
        finally:
            await self.stop()

    def start_self_check(self, interval_s: float | None = None, timeout_s: float | None = None) -> BusSelfCheck:
        """Ask this instance's own health subject over the bus in the background (`BusSelfCheck`); asks failing for
        `self_check_s` while connected and RUNNING stop the service with exit code 69."""
        assert self.bus is not None
        cfg = self.config
        self.self_check = BusSelfCheck(
            self.bus, subjects.health(cfg.namespace, cfg.instance_id), cfg.instance_id, cfg.self_check_s,
            on_fail=lambda reason: self.fail(reason, SELF_CHECK_EXIT),
            active=lambda: self.state is ServiceState.RUNNING, interval_s=interval_s, timeout_s=timeout_s)
        self.spawn(self.self_check.run(), name="bus-self-check")
        return self.self_check

    # --- background tasks -------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, critical: bool = False) -> asyncio.Task[Any]:
        """Run `coro` in the background; its failure is logged (and stops the service if critical)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._on_task_done(t, critical))
        return task

    def _on_task_done(self, task: asyncio.Task[Any], critical: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            BACKGROUND_FAILURES.inc()
            log.error("background task failed", exc_info=exc, extra={"task": task.get_name()})
            if critical:
                self.request_stop()

    async def _cancel_background(self) -> None:
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                async with asyncio.timeout(5):
                    await task


def freeze_heap() -> int:
    """Collect once, then move every object alive to the collector's permanent generation (`gc.freeze`): the
    long-lived state a started process holds (modules, model, pools) is no longer walked by full collections,
    which otherwise stall the event loop for tens of ms each. Objects made later are collected as before; frozen
    ones are still freed by reference counting. Returns how many objects were frozen (counted once here:
    `gc.get_freeze_count` walks them all, ~10 ms per 200k objects, so a health answer must not call it)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("heap frozen", extra={"objects": frozen})
    return frozen


S = TypeVar("S", bound=Service)
C = TypeVar("C", bound=ServiceConfig)


def main(service: type[S] | str, config_cls: type[C], argv: list[str] | None = None) -> int:
    """Entry point for `python -m services.<name>`: exit 2 on bad config or arguments, 1 on start failure.

    `service` may be "module:Class", imported only to run: `--help` lists the settings of `config_cls` at once,
    without importing the service (torch, the model) or connecting to anything."""
    from libs.service.settings import settings_help, unknown_variables  # (lazy: `-m libs.service.settings` runs it)

    args = sys.argv[1:] if argv is None else argv
    prog = f"python -m {service.partition(':')[0].rpartition('.')[0]}" if isinstance(service, str) else "service"
    if args and args[0] in ("-h", "--help"):
        print(settings_help(config_cls, prog))
        return 0
    if args:
        print(f"{prog}: takes no arguments (settings come from WINDSERVE_* variables; see --help)", file=sys.stderr)
        return 2
    try:
        config = load_config(config_cls)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if isinstance(service, str):
        module, _, name = service.partition(":")
        service_cls: type[S] = getattr(importlib.import_module(module), name)
    else:
        service_cls = service
    setup_logging(config.log_level, service=service_cls.role.value, instance=config.instance_id)
    for warning in unknown_variables(os.environ):
        log.warning(warning)
    instance = service_cls(config)
    try:
        asyncio.run(instance.run(watchdog=True))
    except (BusError, OSError) as exc:
        log.error("service failed to start", extra={"error": str(exc)})
        return 1
    # Stopped and flushed: end here. The interpreter's teardown would let C extensions print plain text into the
    # JSON log (triton's bindings, loaded by the compiled step, report "leaked" objects), and nothing is left to do.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(instance.exit_code)
