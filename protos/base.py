"""Wire base: versioned pydantic models serialized with orjson, decoded once at the boundary."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class ProtocolError(Exception):
    """A message could not be decoded into the expected model (bad JSON, schema, or version)."""


class WireModel(BaseModel):
    """Base of every message that crosses a process boundary.

    Messages are immutable and reject unknown fields, so a sender/receiver mismatch fails loudly at
    the boundary instead of silently dropping data. `schema_version` is carried on the wire; a
    receiver refuses a version it does not know (bump `SCHEMA_VERSION` on breaking changes).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    SCHEMA_VERSION: ClassVar[int] = 1

    schema_version: int = 1

    @model_validator(mode="before")
    @classmethod
    def _stamp_version(cls, data: Any) -> Any:
        # Fill in the class's current version when the caller builds a message in code.
        if isinstance(data, dict) and "schema_version" not in data:
            return {**data, "schema_version": cls.SCHEMA_VERSION}
        return data

    @model_validator(mode="after")
    def _check_version(self) -> WireModel:
        if self.schema_version != self.SCHEMA_VERSION:
            raise ValueError(
                f"{type(self).__name__} schema_version {self.schema_version} is not supported "
                f"(this build speaks version {self.SCHEMA_VERSION})"
            )
        return self


M = TypeVar("M", bound=BaseModel)


def encode(msg: BaseModel) -> bytes:
    """Serialize a message to JSON bytes."""
    return orjson.dumps(msg.model_dump(mode="json"))


def decode(data: bytes, model: type[M]) -> M:
    """Parse JSON bytes into `model`; raise ProtocolError naming the model and the problem."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{model.__name__}: payload is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ProtocolError(f"{model.__name__}: expected a JSON object, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ProtocolError(f"{model.__name__}: invalid message ({problems})") from exc
