"""Service configuration: frozen pydantic models filled from `WINDSERVE_<FIELD>` env vars."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, get_origin

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from libs.nesting import field_types, gather, leaves, parts
from protos import subjects

ENV_PREFIX = "WINDSERVE_"


class ConfigError(Exception):
    """The environment does not describe a valid configuration (message names the variables)."""


def new_instance_id() -> str:
    return secrets.token_hex(6)


class ServiceConfig(BaseModel):
    """Settings every service shares. Subclass per service to add its own (narrow) fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated")
    instance_id: str = Field(
        default_factory=new_instance_id,
        pattern=r"^[A-Za-z0-9_\-]+$",
        description="unique id of this instance (a subject token); random when unset",
    )
    namespace: str = Field(
        default=subjects.DEFAULT_NAMESPACE,
        pattern=r"^[A-Za-z0-9_\-]+$",
        description="deployment name: every subject and the registry bucket carry it, so deployments sharing a "
                    "NATS server stay apart",
    )
    nats_replicas: int = Field(
        default=1, ge=1, le=5, description="replicas of the registry bucket and payload store this service creates "
        "when missing (3 on a 3-node NATS cluster, so losing a node loses nothing)")
    registry_ttl_s: int = Field(default=5, ge=1, description="registry entry lifetime without heartbeat, seconds")
    heartbeat_interval_s: float = Field(default=1.0, gt=0, description="registry refresh period, seconds")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="NATS connect timeout, seconds")
    registry_timeout_s: float = Field(default=2.0, gt=0, description="max time one registry listing may take")
    drain_timeout_s: float = Field(
        default=10.0, gt=0, description="max wait for in-flight work on shutdown (the gateway ends requests still "
        "running at 80% of it with an error event; make run waits 5 s more before killing)")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus HTTP port; 0 = off")
    metrics_host: str = Field(default="127.0.0.1", description="bind address of the metrics endpoint")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="log level")
    data_address: str = Field(default="", description="address peers use for bulk data (UCX/TCP)")
    capacity: int = Field(default=0, ge=0, description="advertised capacity (role-specific units)")
    labels: dict[str, str] = Field(default_factory=dict, description="registry labels, JSON object")
    model: str = Field(default="", description="model directory (HF layout); empty until a model is loaded")
    loop_watchdog_s: float = Field(
        default=60.0, ge=0, description="exit (code 70) when the event loop has not run for this long, so a restart "
        "policy restarts the service (libs/service/watchdog.py); 0 = off")
    gc_freeze: bool = Field(
        default=True, description="once started, move every object alive then (imports, model, pools) to the "
        "garbage collector's permanent generation (gc.freeze), so its full collections stop walking them: a full "
        "pass over a started cache node's ~200k objects took ~100 ms of the loop")
    self_check_s: float = Field(
        default=30.0, ge=0, description="exit (code 69) when this instance's own health subscription has not "
        "answered it over the bus for this long while the NATS connection is up (its subscriptions are gone), so "
        "a restart policy restarts the service (libs/service/selfcheck.py); not counted while NATS is "
        "unreachable; 0 = off")

    @model_validator(mode="before")
    @classmethod
    def _gather_parts(cls, data: Any) -> Any:
        """A part's settings may come flat (`WorkerConfig(page_size=8)`, `WINDSERVE_PAGE_SIZE`): gather them into
        the part, over its default."""
        if not isinstance(data, dict):
            return data
        return gather(cls, data, lambda name: cls.model_fields[name].get_default(call_default_factory=True))

    @model_validator(mode="after")
    def _heartbeat_below_ttl(self) -> ServiceConfig:
        if self.heartbeat_interval_s >= self.registry_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be below registry_ttl_s "
                f"({self.registry_ttl_s}) or the entry expires between heartbeats"
            )
        return self


class TransferServiceConfig(ServiceConfig):
    """A service that moves bytes to or from peers over its own transfer engine (UCX / TCP)."""

    transfer_host: str = Field(default="127.0.0.1", description="bind address of the transfer engine")
    advertise_host: str = Field(default="", description="host peers dial for bytes (empty: transfer_host, or this "
                                "host's IP when binding 0.0.0.0)")


class SenderServiceConfig(TransferServiceConfig):
    """A service that serves values to clients over its transfer engine (GCache nodes, encoders)."""

    transfer_port: int = Field(default=0, ge=0, le=65535, description="port of the transfer engine; 0 = any free")
    send_timeout_s: float = Field(default=30.0, gt=0, description="bound of sending one answer's bytes")


C = TypeVar("C", bound=ServiceConfig)


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def leaf_type(cls: type, leaf: str) -> Any:
    """The annotation of setting `leaf` of `cls` or of one of its parts."""
    for name in leaves(cls)[leaf]:
        cls = parts(cls)[name]
    return field_types(cls)[leaf]


def _parse(raw: str, annotation: Any) -> Any:
    # Containers arrive as JSON; scalars stay strings and pydantic's lax mode converts them.
    containers = (dict, list, tuple)
    if get_origin(annotation) in containers or annotation in containers or _optional_tuple(annotation):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"expected a JSON value, got {raw!r} ({exc})") from exc
    return raw


def load_config(cls: type[C], env: Mapping[str, str] | None = None, **overrides: Any) -> C:
    """Build `cls` from `WINDSERVE_<FIELD>` variables (unset ones keep defaults), then overrides.

    Raises ConfigError naming each offending variable and why.
    """
    source = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, path in leaves(cls).items():
        key = env_name(name)
        if key in source:
            annotation = leaf_type(cls, name)
            try:
                values[name] = _parse(source[key], annotation)
                if path:  # a part's field: a dataclass does not convert strings, so convert here
                    values[name] = TypeAdapter(annotation).validate_python(values[name])
            except ConfigError as exc:
                raise ConfigError(f"{cls.__name__}: {key}: {exc}") from exc
            except ValidationError as exc:
                raise ConfigError(f"{cls.__name__}: {key}: {exc.errors()[0]['msg']} (got {source[key]!r})") from exc
    values.update(overrides)
    try:
        return cls(**values)
    except ValidationError as exc:
        raise ConfigError(f"invalid {cls.__name__}: " + "; ".join(_describe(e) for e in exc.errors())) from exc


def _optional_tuple(annotation: Any) -> bool:
    """`tuple[int, ...] | None` and the like: a container that may be absent."""
    return any(get_origin(a) in (tuple, list) for a in getattr(annotation, "__args__", ()))


def _describe(err: Any) -> str:
    loc = err["loc"]
    if loc:
        return f"{env_name(str(loc[0]))}: {err['msg']} (got {err.get('input')!r})"
    return str(err["msg"])

