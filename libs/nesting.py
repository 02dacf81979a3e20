"""Configs composed of parts: a config (a frozen dataclass or a pydantic model) may hold other configs as fields,
each setting declared once, in the part of the layer that owns it.

Every field name is unique across a config and all its parts (tests/test_settings.py checks it), so a flat name
says where it belongs: `@composed` (dataclasses) and `gather` (which `ServiceConfig` runs before validating) let
callers pass a part's fields flat, `EngineConfig(max_num_seqs=8)` being `EngineConfig(scheduler=
SchedulerConfig(max_num_seqs=8))`, and one `WINDSERVE_<FIELD>` variable names one setting wherever it lives.
"""

from __future__ import annotations

import dataclasses
import typing
from functools import cache
from typing import Any


def is_config(tp: Any) -> bool:
    """A config class: a dataclass or a pydantic model (anything with `model_fields`)."""
    return isinstance(tp, type) and (dataclasses.is_dataclass(tp) or hasattr(tp, "model_fields"))


@cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, in declaration order."""
    if hasattr(cls, "model_fields"):
        return {name: f.annotation for name, f in cls.model_fields.items()}
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


@cache
def parts(cls: type) -> dict[str, type]:
    """The fields of `cls` that are configs themselves."""
    return {name: tp for name, tp in field_types(cls).items() if is_config(tp)}


@cache
def leaves(cls: type) -> dict[str, tuple[str, ...]]:
    """Every setting of `cls` and its parts: leaf field name -> its path of part names (() = `cls` itself)."""
    found: dict[str, tuple[str, ...]] = {}
    for name in field_types(cls):
        if name in parts(cls):
            found.update({leaf: (name, *path) for leaf, path in leaves(parts(cls)[name]).items()})
        else:
            found[name] = ()
    return found


def values_of(config: Any) -> dict[str, Any]:
    """A config's own field values (parts as objects), to rebuild it with changes."""
    return {name: getattr(config, name) for name in field_types(type(config))}


def gather(cls: type, kwargs: dict[str, Any], default_part: typing.Callable[[str], Any]) -> dict[str, Any]:
    """`kwargs` with each part's flat fields gathered into that part: the part given (or `default_part(name)`,
    None = the part's own defaults) with those fields changed."""
    out = dict(kwargs)
    for name, part in parts(cls).items():
        mine = {k: out.pop(k) for k in list(out) if k in leaves(part)}
        if not mine:
            continue
        base = out.pop(name, None)
        if base is None:
            base = default_part(name)
        given = {**values_of(base), **mine} if base is not None else mine
        out[name] = part(**gather(part, given, lambda _: None))
    return out


def composed(cls):
    """Class decorator for a frozen config dataclass with parts: its constructor (so `dataclasses.replace` too)
    also takes the parts' fields flat."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **gather(cls, kwargs, lambda name: None))

    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__
    return cls
