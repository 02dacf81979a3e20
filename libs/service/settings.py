"""Every `WINDSERVE_*` setting: name, default, type, owner (the config class that declares it), the roles that read
it and one line of description, from the config classes themselves.

    python -m libs.service.settings [--role ROLE]   # a table on stdout
    python -m libs.service.settings --write         # regenerate docs/settings.md (tests/test_settings.py checks it)

A service's config composes parts (libs/nesting.py); each setting is declared once, in the part of the layer that
owns it, and read flat from `WINDSERVE_<FIELD>`. Descriptions come from a pydantic field's `description` or from
the docstring under a dataclass field.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import functools
import importlib
import inspect
import os
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from libs.nesting import field_types, parts
from libs.service.config import ENV_PREFIX, env_name, new_instance_id

# role (as `scripts.run --services` names it) -> its config class, imported only when asked for
ROLES = {
    "gateway": "services.gateway.config:GatewayConfig",
    "router": "services.router.config:RouterConfig",
    "encoder": "services.encoder.config:EncoderConfig",
    "worker": "services.worker.config:WorkerConfig",
    "prefill": "services.prefill.config:PrefillConfig",
    "decode": "services.decode.config:DecodeConfig",
    "cache": "services.gcache.config:CacheConfig",
    "planner": "services.planner.config:PlannerConfig",
}
DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


@dataclass(frozen=True)
class Setting:
    name: str  # the env var
    default: str
    type: str
    owner: str  # the class that declares it
    description: str
    roles: tuple[str, ...] = ()


def role_config(role: str) -> type:
    module, _, name = ROLES[role].partition(":")
    return getattr(importlib.import_module(module), name)


def declaring_class(cls: type, name: str) -> type:
    """The class in `cls`'s bases that declares field `name` (its own annotation)."""
    for base in inspect.getmro(cls):
        if name in base.__dict__.get("__annotations__", {}):
            return base
    return cls


@cache
def _docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in `cls`'s source (dataclass attribute docstrings)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    found = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            found[node.target.id] = after.value.value
    return found


def _description(cls: type, name: str) -> str:
    if hasattr(cls, "model_fields"):
        text = cls.model_fields[name].description or ""
    else:
        text = _docstrings(declaring_class(cls, name)).get(name, "")
    return " ".join(text.split())


def _default(config: Any, cls: type, name: str) -> str:
    if hasattr(cls, "model_fields") and cls.model_fields[name].default_factory is new_instance_id:
        return "random"
    value = getattr(config, name)
    if isinstance(value, (tuple, frozenset, list)):
        value = list(value)
    return "" if value == "" else repr(value)


def _type(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return re.sub(r"typing\.|libs\.\w+\.\w+\.", "", str(text))


def settings_of(cls: type, config: Any | None = None) -> list[Setting]:
    """Every setting of `cls` and its parts, defaults taken from `config` (default: `cls()`), so a part's default
    is the one its owner gives it."""
    config = cls() if config is None else config
    rows = []
    for name, annotation in field_types(cls).items():
        if name in parts(cls):
            rows += settings_of(parts(cls)[name], getattr(config, name))
            continue
        owner = declaring_class(cls, name)
        rows.append(Setting(env_name(name), _default(config, cls, name), _type(annotation), owner.__name__,
                            _description(cls, name)))
    return rows


@contextlib.contextmanager
def _bare_environment():
    """No WINDSERVE_* variable set while defaults are computed (a default may follow one, e.g. compile)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(ENV_PREFIX)}
    try:
        yield
    finally:
        os.environ.update(saved)


# Read where no config class is at hand (the transfer engine is built deep inside libraries), by every role.
PROCESS_WIDE = [
    Setting("WINDSERVE_TRANSFER", "", "str", "libs.transfer.select_backend",
            "ucx or tcp: the transfer engine of every process; empty = UCX when ucxx is installed, else TCP."),
]


# Read by the tools around the services (compose files, image builds, benchmarks, tests), not by a service.
TOOL_VARIABLES = frozenset({
    "WINDSERVE_BASE_IMAGE", "WINDSERVE_IMAGE", "WINDSERVE_TORCH_WHEEL", "WINDSERVE_TORCH_INDEX_URL",
    "WINDSERVE_MODEL_DIR", "WINDSERVE_HTTP_BIND", "WINDSERVE_CACHE_MEMORY_BYTES", "WINDSERVE_CACHE_DISK_BYTES",
    "WINDSERVE_PEER_DIR", "WINDSERVE_SCHEMATHESIS_EXAMPLES",
})


def all_settings(roles: list[str] | None = None) -> list[Setting]:
    """Every setting of the given roles (default: all), once each, with the roles that read it and the default
    each has when no WINDSERVE_* variable is set."""
    merged: dict[str, Setting] = {}
    with _bare_environment():
        configs = {role: settings_of(role_config(role)) for role in roles or list(ROLES)}
    for role, settings in configs.items():
        for s in settings:
            seen = merged.get(s.name)
            merged[s.name] = dataclasses.replace(s, roles=(*seen.roles, role) if seen else (role,))
    return list(merged.values()) + [dataclasses.replace(s, roles=tuple(configs)) for s in PROCESS_WIDE]


def first_sentence(text: str) -> str:
    """The description's first sentence: one line of the table (the class holds the rest)."""
    return re.split(r"(?<=[.!?])\s+(?=[A-Z(])", text, maxsplit=1)[0]


def settings_help(cls: type, prog: str) -> str:
    """`--help` of a service: its settings, one line each, defaults as with no WINDSERVE_* variable set."""
    with _bare_environment():
        rows = settings_of(cls) + PROCESS_WIDE
    width = max(len(r.name) for r in rows)
    doc = (cls.__doc__ or "").strip().splitlines()
    lines = [f"usage: {prog}", "", *doc[:1], "",
             "Settings come from environment variables (JSON for lists and objects); docs/settings.md has them all.",
             ""]
    lines += [f"  {r.name:{width}}  {r.default or chr(39) * 2:>14}  {first_sentence(r.description)}" for r in rows]
    return "\n".join(lines)


@functools.cache
def known_variables() -> frozenset[str]:
    return frozenset(s.name for s in all_settings()) | TOOL_VARIABLES


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """A warning per WINDSERVE_* variable no part of windserve reads, naming the closest known one: a misspelled
    setting would otherwise be ignored in silence."""
    known = known_variables()
    warnings = []
    for name in sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known):
        bare = {k.removeprefix(ENV_PREFIX): k for k in known}  # the shared prefix would make any two look close
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), list(bare), n=1, cutoff=0.75)
        hint = f"; did you mean {bare[close[0]]}?" if close else ""
        warnings.append(f"{name} is not a windserve setting and is ignored{hint} (docs/settings.md)")
    return warnings


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    rows = all_settings()
    owners: dict[str, list[Setting]] = {}
    for s in rows:
        owners.setdefault(s.owner, []).append(s)
    out = ["# Settings", "",
           "Generated by `python -m libs.service.settings --write` from the config classes; do not edit. Every "
           "service reads its settings from `WINDSERVE_<FIELD>` environment variables (JSON for lists and objects). "
           "Each setting is declared once, in the config class of the layer that owns it (the heading), and the "
           "services that compose that class read it (roles).", ""]
    for owner, settings in owners.items():
        roles = sorted({r for s in settings for r in s.roles}, key=list(ROLES).index)
        out += [f"## {owner}", "", f"Read by: {', '.join(roles)}.", "", "| variable | default | description |",
                "|---|---|---|"]
        out += [f"| `{s.name}` | {_cell(s.default) or '—'} | {_cell(first_sentence(s.description))} |"
                for s in settings]
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m libs.service.settings", description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=list(ROLES), help="only the settings this role reads")
    parser.add_argument("--write", action="store_true", help=f"regenerate {DOC.relative_to(DOC.parents[1])}")
    args = parser.parse_args()
    if args.write:
        DOC.write_text(markdown())
        return
    for s in all_settings([args.role] if args.role else None):
        default = s.default or "''"
        print(f"{s.name:40} {default:>12}  {s.type:10} {s.owner:22} {first_sentence(s.description)}")


if __name__ == "__main__":
    main()
