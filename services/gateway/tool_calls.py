"""Tool calls in a model's output (pure): the output formats, the grammars that constrain them, and one parser
that serves both whole responses and streams.

Two formats, chosen by the checkpoint's chat template (`tool_format_for`), never by the model's name:
**hermes** (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`) and **xml** (MiMo-V2.6:
`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`). `ToolCallStream`
splits a choice's text as it arrives: text before a call is content, call markup never is; a call is
announced once its name is complete and its arguments follow as JSON-text fragments. The whole-response
path feeds the same stream, so a streamed choice accumulates to exactly the non-streamed message.
Details: docs/gateway.md, "Tool calling".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TRIGGER = "<tool_call>"
CLOSE = "</tool_call>"
HERMES = "hermes"
XML = "xml"
TOOL_FORMATS = (HERMES, XML)


def tool_format_for(template: str | None) -> str:
    """The tool-call format a chat template teaches its model: xml when it renders calls as
    `<function=...><parameter=...>` (MiMo-V2.6, Qwen3-Coder), else hermes (also without a template)."""
    if template and "<function=" in template and "<parameter=" in template:
        return XML
    return HERMES


# --- grammars (structural tags, compiled by libs.engine.grammar) ---------------------------------------------


def _hermes_tag(name: str, arguments_ebnf: str) -> dict[str, Any]:
    return {"type": "tag", "begin": f'{TRIGGER}\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": {"type": "grammar", "grammar": arguments_ebnf}, "end": f"}}\n{CLOSE}"}


def _xml_tag(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tag", "begin": f"{TRIGGER}<function={name}>",
            "content": {"type": "json_schema", "json_schema": parameters, "style": "qwen_xml"},
            "end": f"</function>{CLOSE}"}


def call_tags(fmt: str, tools: Sequence[tuple[str, dict[str, Any] | None]],
              arguments_ebnf: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """One structural-tag `tag` per tool (name, parameter schema or None = any object). `arguments_ebnf` turns a
    schema into the EBNF of its JSON (hermes: the same compact JSON as response_format)."""
    if fmt == XML:
        return [_xml_tag(n, p if p is not None else {"type": "object"}) for n, p in tools]
    return [_hermes_tag(n, arguments_ebnf(p if p is not None else {"type": "object"})) for n, p in tools]


def separator(fmt: str) -> str:
    return "\n" if fmt == HERMES else ""


def auto_format(fmt: str, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice auto: any text; once `<tool_call>` appears, a complete well-formed call of one of the tools
    (then text again; with parallel_tool_calls false, nothing after the one call)."""
    return {"type": "triggered_tags", "triggers": [TRIGGER], "tags": tags, "stop_after_first": not parallel}


def calls_format(fmt: str, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """At least one call (exactly one unless parallel), nothing else."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator(fmt), "at_least_one": True,
            "stop_after_first": not parallel}


def structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


# --- parsing ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """How far one call has come, from the text after its `<tool_call>`: the function name once complete,
    the arguments JSON text so far (only ever growing), whether the arguments are complete, and `end`: the
    index just after `</tool_call>` once the call is closed. `bad`: this can never be a call."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False
    end: int | None = None
    bad: bool = False


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_HERMES_TAIL = re.compile(r"\s*\}\s*" + re.escape(CLOSE))
_HEAD_PREFIX_MAX = 96  # an xml head this long without its ">" is none (function names are at most 64 characters)


def json_value_end(text: str, start: int) -> int | None:
    """Index just after the JSON object or array that begins at text[start] (strings and escapes respected),
    or None while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _hermes_whole(body: str) -> Progress:
    """A closed call whose head is not in the streaming order (e.g. arguments before name): parsed whole."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return Progress(bad=True)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Progress(bad=True)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Progress(bad=True)
    if not isinstance(args, dict):
        return Progress(bad=True)
    return Progress(obj["name"], json.dumps(args, ensure_ascii=False), True)


def _hermes_closed(rest: str, close: int) -> Progress:
    """The call that `rest[:close]` holds, parsed whole, ending after the `</tool_call>` at `close`."""
    whole = _hermes_whole(rest[:close])
    return whole if whole.bad else Progress(whole.name, whole.arguments, True, close + len(CLOSE))


def hermes_progress(rest: str, params: Mapping[str, Any]) -> Progress:
    """`rest`: the text after `<tool_call>`. Arguments stream as their raw text (an object or array); the
    call closes at the first `</tool_call>` after them."""
    head = _HERMES_HEAD.match(rest)
    if head is None:
        close = rest.find(CLOSE)
        if close < 0:
            return Progress(bad=bool(rest.strip()) and not rest.lstrip().startswith("{"))
        return _hermes_closed(rest, close)
    try:
        name = json.loads(f'"{head.group(1)}"')
    except json.JSONDecodeError:
        return Progress(bad=True)
    start = head.end()
    if start >= len(rest):
        return Progress(name)
    if rest[start] not in "{[":  # arguments as a JSON string (or malformed): only whole, at the close
        close = rest.find(CLOSE, start)
        if close < 0:
            return Progress(name)
        return _hermes_closed(rest, close)
    end = json_value_end(rest, start)
    if end is None:
        return Progress(name, rest[start:])
    tail = _HERMES_TAIL.match(rest, end)
    return Progress(name, rest[start:end], True, tail.end() if tail else None)


_XML_HEAD = re.compile(r"\s*<function=([^>\s]+)>")
_XML_PARAM = re.compile(r"\s*<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
_XML_TAIL = re.compile(r"\s*</function>\s*" + re.escape(CLOSE))


def _is_string(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return bool(values) and all(isinstance(v, str) for v in values)


def _resolved(schema: Any, root: Any) -> Any:
    """`schema` with a local `$ref` ("#/$defs/x") followed within `root` (a few hops at most)."""
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#")):
            return schema
        target = root
        for part in filter(None, ref[1:].split("/")):
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(target, dict) else {}
        schema = target
    return schema


def xml_value(raw: str, schema: Any) -> Any:
    """A parameter's value: a string parameter's raw text as it is (the template says values are kept exactly),
    anything else its JSON (raw text when it is not JSON: an untyped parameter may be plain text)."""
    if _is_string(schema):
        return raw
    if isinstance(schema, dict) and "type" not in schema and not raw.lstrip().startswith(("{", "[")):
        return raw  # untyped: xgrammar's qwen_xml allows text, an object or an array
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def xml_progress(rest: str, params: Mapping[str, Any]) -> Progress:
    """`rest`: the text after `<tool_call>`. Arguments grow by one `"key": value` per closed parameter."""
    head = _XML_HEAD.match(rest)
    if head is None:
        s = rest.lstrip()
        return Progress(bad=len(s) > _HEAD_PREFIX_MAX or not (s.startswith("<function=") or "<function=".startswith(s)))
    name = head.group(1)
    root = params.get(name) or {}
    props = root.get("properties", {})
    pos, parts = head.end(), []
    while (m := _XML_PARAM.match(rest, pos)) is not None:
        key, raw = m.group(1), m.group(2)
        parts.append(f"{json.dumps(key, ensure_ascii=False)}: "
                     f"{json.dumps(xml_value(raw, _resolved(props.get(key), root)), ensure_ascii=False)}")
        pos = m.end()
    arguments = "{" + ", ".join(parts)
    tail = _XML_TAIL.match(rest, pos)
    if tail is None:
        return Progress(name, arguments)
    return Progress(name, arguments + "}", True, tail.end())


_PROGRESS = {HERMES: hermes_progress, XML: xml_progress}


def _held_suffix(text: str) -> int:
    """Characters at the end of content text that must wait: the longest suffix that is a prefix of
    `<tool_call>`."""
    return next((k for k in range(min(len(TRIGGER) - 1, len(text)), 0, -1) if text.endswith(TRIGGER[:k])), 0)


@dataclass
class _Call:
    index: int
    id: str
    name: str
    arguments: str = ""  # sent so far
    complete: bool = False


@dataclass
class ToolCallStream:
    """One chat choice's tool-call split (see the module docstring). `feed(text)` and `finish()` return
    (content delta, tool-call deltas in OpenAI's `delta.tool_calls` shape); `content` and `openai_calls()` are
    the whole message so far."""

    fmt: str
    params: Mapping[str, Any]  # declared function name -> its parameter schema (None: any object)
    call_id: Callable[[int], str]
    content: str = ""
    calls: list[_Call] = field(default_factory=list)
    _held: str = ""  # content mode: text not released yet; call mode: the text after the open trigger
    _calling: bool = False
    _after_call: bool = False  # blanks right after a call are dropped (they separate parallel calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        out, deltas = "", list[dict[str, Any]]()
        buf = self._held + text
        while True:
            if not self._calling:
                if self._after_call:
                    buf = buf.lstrip()
                    self._after_call = not buf
                start = buf.find(TRIGGER)
                if start < 0:
                    keep = _held_suffix(buf)
                    self._held = buf[len(buf) - keep:]
                    return out + self._content(buf[:len(buf) - keep]), deltas
                out += self._content(buf[:start])
                self._calling, buf = True, buf[start + len(TRIGGER):]
                continue
            p = _PROGRESS[self.fmt](buf, self.params)
            current = self.calls[-1] if self.calls and not self.calls[-1].complete else None
            if current is None and (p.bad or (p.name is not None and p.name not in self.params)):
                out += self._content(TRIGGER)  # not a call of a declared function: content
                self._calling = False
                continue
            deltas += self._call_deltas(current, p)
            if p.end is None:  # still open
                self._held = buf
                return out, deltas
            self.calls[-1].complete = True
            self._calling, self._after_call, buf = False, True, buf[p.end:]

    def _call_deltas(self, current: _Call | None, p: Progress) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if current is None:
            if p.name is None:
                return deltas
            current = _Call(len(self.calls), self.call_id(len(self.calls)), p.name)
            self.calls.append(current)
            deltas.append({"index": current.index, "id": current.id, "type": "function",
                           "function": {"name": current.name, "arguments": ""}})
        if len(p.arguments) > len(current.arguments):
            deltas.append({"index": current.index, "function": {"arguments": p.arguments[len(current.arguments):]}})
            current.arguments = p.arguments
        return deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The choice ended: release held content, or an open trigger that never named a function; a call cut
        short (max_tokens) keeps the arguments it got."""
        held, self._held = self._held, ""
        if self._calling:
            self._calling = False
            if self.calls and not self.calls[-1].complete:
                return "", []
            return self._content(TRIGGER + held), []
        return self._content(held), []

    def _content(self, text: str) -> str:
        self.content += text
        return text

    def openai_calls(self) -> list[dict[str, Any]]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls]


def parse_tool_calls(text: str, names: Sequence[str], fmt: str = HERMES,
                     params: Mapping[str, Any] | None = None) -> tuple[str, list[tuple[str, str]]] | None:
    """The tool calls in a whole text: (the text around them, [(function name, arguments JSON text)]); None when
    it has none, or when any `<tool_call>` is not a complete call of a function in `names` (then it all stays
    content)."""
    stream = ToolCallStream(fmt, params if params is not None else dict.fromkeys(names), lambda i: str(i))
    stream.feed(text)
    stream.finish()
    if not stream.calls or text.count(TRIGGER) != len(stream.calls) or not stream.calls[-1].complete:
        return None
    for c in stream.calls:
        try:
            if not isinstance(json.loads(c.arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
    return stream.content, [(c.name, c.arguments) for c in stream.calls]
