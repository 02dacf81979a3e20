"""Grammar-constrained decoding with xgrammar: structured outputs (`response_format`) and forced tool calls.

A `GrammarSpec` (pure, on the wire) becomes EBNF (`grammar_ebnf`, no tokenizer needed: the gateway
validates with it), then a `CompiledGrammar` per tokenizer (`GrammarCache`, keyed by `spec_key`), then one
matcher per sequence (`GrammarBook`). Per step only the constrained rows of a batch are masked. A matcher
catches up on output tokens it has not seen, so a disaggregated decode engine rebuilds it from the wire
parameters and the first token, and a preempted sequence keeps it. Schemas compile with compact separators
and no free whitespace; `_fix_string_chars` keeps control characters and surrogates out of strings, which
xgrammar would let in. Details: docs/gateway.md, "Structured outputs".
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from libs.engine.request import GrammarSpec

log = logging.getLogger(__name__)

# JSON-schema keywords the conversion honours. Anything else is refused (a keyword xgrammar would silently
# drop would let outputs through that do not validate).
SUPPORTED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
    "anyOf", "oneOf", "$ref", "$defs", "definitions", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minProperties",
    "maxProperties", "title", "description", "default", "examples", "$schema", "$id", "$comment",
})
# string formats xgrammar turns into a pattern (it accepts any other name and ignores it)
SUPPORTED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# keywords whose value is a mapping of names to subschemas (the names are data, not keywords)
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
# xgrammar 0.2.9's classes for the characters of a maxLength-bounded and of an unbounded string: the first lets
# control characters in, both let UTF-16 surrogates (U+D800-DFFF, not valid in UTF-8) in
_BAD_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_GOOD_STRING_CHARS = r'[^\0-\x1f\"\\\uD800-\uDFFF]'  # what JSON allows unescaped, as valid UTF-8
# the characters of a raw-text (qwen_xml) parameter value in xgrammar 0.2.9: every code point, surrogates included
_BAD_TEXT_CHARS = r"[\0-\U0010ffff]"
_GOOD_TEXT_CHARS = r"[^\uD800-\uDFFF]"
_FREE_WHITESPACE = r"[ \n\r\t]*"  # the optional blanks of xgrammar's XML-style tool arguments
TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # a reasoning model's tags (services/gateway/reasoning.py)


class GrammarError(ValueError):
    """A spec that cannot be compiled: invalid JSON, an invalid schema, or unsupported schema features."""


def canonical_json(obj: Any) -> str:
    """Deterministic compact JSON text: the form a spec is hashed and sent in. Keys keep their order (the
    order of `properties` is the order the output follows, so it is part of the grammar)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def spec_key(spec: GrammarSpec) -> int:
    """Cache key of a spec: xxhash64 of its kind, parallel flag and canonical schema (never hash())."""
    schema = canonical_json(json.loads(spec.schema)) if spec.schema else ""
    return xxhash.xxh64_intdigest(f"{spec.kind}\0{int(spec.parallel)}\0{spec.reasoning}\0{schema}".encode())


def unsupported_keywords(schema: Any, path: str = "") -> list[str]:
    """Paths of the schema keywords outside SUPPORTED_KEYWORDS (e.g. `properties.x.not`), depth first."""
    out: list[str] = []
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            out += unsupported_keywords(sub, f"{path}{i}.")
        return out
    if not isinstance(schema, dict):
        return out
    for key, value in schema.items():
        if key not in SUPPORTED_KEYWORDS:
            out.append(f"{path}{key}")
        elif key == "format" and value not in SUPPORTED_FORMATS:
            out.append(f"{path}format={value}")
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                out += unsupported_keywords(sub, f"{path}{key}.{name}.")
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties"):
            out += unsupported_keywords(value, f"{path}{key}.")
    return out


def parse_schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise GrammarError("a JSON schema must be an object (or a boolean)")
    bad = unsupported_keywords(schema)
    if bad:
        raise GrammarError(f"unsupported JSON schema feature(s): {', '.join(bad)}")
    return schema


def schema_ebnf(schema: Any) -> str:
    """EBNF of a JSON schema's compact JSON (root rule `root`), with valid UTF-8 string characters."""
    return _schema_text_ebnf(canonical_json(schema))


@functools.lru_cache(maxsize=1024)
def _schema_text_ebnf(text: str) -> str:
    # cached by the schema's canonical text: a gateway converts every tool's schema of every auto-tools request
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    except Exception as exc:  # xgrammar raises RuntimeError / InvalidJSONError with the converter's reason
        raise GrammarError(f"invalid JSON schema: {_first_line(exc)}") from exc
    return bound_numbers(_fix_string_chars(str(grammar)))


# A number the schema does not bound is bounded here, so it fits what JSON parsers hold and a weak model cannot run
# to max_tokens inside one: integers to 18 digits (always inside int64), other numbers to 16 integer and 16
# fraction digits and a 3-digit exponent. A schema's own minimum / maximum make their own rules, untouched.
_NUMBER_RULES = {
    'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]*))':
        'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]{0, 17}))',
    'basic_number_2 ::= (("0") | ([1-9] [0-9]*))': 'basic_number_2 ::= (("0") | ([1-9] [0-9]{0, 15}))',
    'basic_number_3 ::= ("" | ("." basic_number_digits{1, -1}))':
        'basic_number_3 ::= ("" | ("." basic_number_digits{1, 16}))',
    'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, -1}))':
        'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, 3}))',
}


def bound_numbers(ebnf: str) -> str:
    """`ebnf` with xgrammar's unbounded JSON number rules replaced by bounded ones (`_NUMBER_RULES`)."""
    for unbounded, bounded in _NUMBER_RULES.items():
        ebnf = ebnf.replace(unbounded, bounded)
    return ebnf


def _fix_string_chars(ebnf: str) -> str:
    for bad in _BAD_STRING_CHARS:
        ebnf = ebnf.replace(bad, _GOOD_STRING_CHARS)
    return ebnf.replace(_BAD_TEXT_CHARS, _GOOD_TEXT_CHARS)


def _structural_tag_ebnf(text: str) -> str:
    """EBNF of an xgrammar structural tag (JSON text). Its JSON and XML-style contents get the same treatment
    as schemas: no free whitespace (xgrammar's qwen_xml style allows blanks around every tag and value, and
    `max_whitespace_cnt` cannot be 0) and valid UTF-8 string characters."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_structural_tag(text)
    except Exception as exc:  # InvalidStructuralTagError, InvalidJSONError, RuntimeError with the reason
        raise GrammarError(f"invalid structural tag: {_first_line(exc)}") from exc
    return bound_numbers(_fix_string_chars(str(grammar).replace(_FREE_WHITESPACE, '""')))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line.split(": ", 1)[-1] if line.startswith("[") else line  # drop xgrammar's "[time] file:line: "


def grammar_ebnf(spec: GrammarSpec) -> tuple[str, str]:
    """(EBNF text, root rule name) of a spec; raises GrammarError when the spec cannot be served."""
    ebnf, root = _body_ebnf(spec)
    if not spec.reasoning:
        return ebnf, root
    # a reasoning model's chat: any text up to `</think>` (TagDispatch stops at it), a few blank characters,
    # then the constrained answer; "detect": the output may skip the reasoning and start with the answer
    think = (f"{json.dumps(THINK_OPEN)} " if spec.reasoning == "detect" else "") + \
        f"ws_reasoning_text {json.dumps(THINK_CLOSE)} [ \\n]{{0,4}}"
    rules = (f'ws_reasoning_text ::= TagDispatch(loop_after_dispatch=false, excludes=({json.dumps(THINK_CLOSE)}))\n'
             f"ws_reasoning_root ::= {think} {root}" + (f" | {root}" if spec.reasoning == "detect" else ""))
    return f"{ebnf}\n{rules}\n", "ws_reasoning_root"


def _body_ebnf(spec: GrammarSpec) -> tuple[str, str]:
    if spec.kind == "json_object":
        return schema_ebnf({"type": "object"}), "root"
    if spec.kind == "structural_tag":
        return _structural_tag_ebnf(spec.schema), "root"
    schema = parse_schema(spec.schema)
    ebnf = schema_ebnf(schema)
    if spec.kind == "json_schema":
        return ebnf, "root"
    # tool calls: the schema is one call object; wrap it in the model's tags (Qwen / Hermes style)
    call = f'{json.dumps(TOOL_CALL_OPEN)} root {json.dumps(TOOL_CALL_CLOSE)}'
    more = f' ("\\n" {call})*' if spec.parallel else ""
    return f"{ebnf}\ntool_calls_root ::= {call}{more}\n", "tool_calls_root"


_VALID: OrderedDict[int, None] = OrderedDict()  # spec_key of specs validate_spec accepted (bounded)


def validate_spec(spec: GrammarSpec) -> None:
    """Raise GrammarError unless the spec converts and parses as a grammar (no tokenizer needed). Specs seen
    valid before are not converted again (a worker validates each request's params more than once)."""
    import xgrammar as xgr

    key = spec_key(spec)
    if key in _VALID:
        return
    ebnf, root = grammar_ebnf(spec)
    try:
        xgr.Grammar.from_ebnf(ebnf, root_rule_name=root)
    except Exception as exc:
        raise GrammarError(f"the grammar of this request does not compile: {_first_line(exc)}") from exc
    _VALID[key] = None
    if len(_VALID) > 1024:
        _VALID.popitem(last=False)


def encoded_vocab(tokenizer, vocab_size: int) -> list[bytes]:
    """The raw bytes of every token id below the model's vocab_size, for xgrammar's RAW vocab type. Special
    tokens (and ids the tokenizer does not have: a model's padded vocab) are empty, which xgrammar never
    allows inside a grammar: `<|im_start|>` must not appear in a JSON string. The reasoning tags keep their text
    where a tokenizer calls them special: a grammar that follows the reasoning needs them."""
    specials = {i for t, i in getattr(tokenizer, "special_tokens", {}).items() if t not in (THINK_OPEN, THINK_CLOSE)}
    size = min(vocab_size, getattr(tokenizer, "vocab_size", vocab_size))
    return [b"" if i in specials else tokenizer.token_bytes(i) for i in range(size)] + [b""] * (vocab_size - size)


class GrammarCache:
    """Compiles specs for one tokenizer, keeping up to `max_entries` compiled grammars (LRU, keyed by spec_key).
    `compile_seconds` records how long each fresh compile took (benchmarks read it)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], max_entries: int = 256,
                 max_threads: int = 1) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(encoded_vocab(tokenizer, vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids))
        # xgrammar's own cache is off: this one is keyed by the spec hash and bounded by entries
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._compiled: OrderedDict[int, Any] = OrderedDict()
        self.max_entries = max_entries
        self.compile_seconds: list[float] = []
        self.hits = 0

    def compile(self, spec: GrammarSpec):
        key = spec_key(spec)
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            self.hits += 1
            return hit
        t0 = time.perf_counter()
        ebnf, root = grammar_ebnf(spec)
        try:
            compiled = self._compiler.compile_grammar(ebnf, root_rule_name=root)
        except Exception as exc:
            raise GrammarError(f"the grammar of this request does not compile: {_first_line(exc)}") from exc
        self.compile_seconds.append(time.perf_counter() - t0)
        self._compiled[key] = compiled
        if len(self._compiled) > self.max_entries:
            self._compiled.popitem(last=False)
        return compiled


@dataclass
class _Matcher:
    matcher: Any  # xgrammar.GrammarMatcher
    accepted: int = 0  # output tokens it has accepted
    broken: bool = False  # it refused a token: constraining stopped (logged)


@dataclass(frozen=True)
class ConstrainedRow:
    """A logits row to constrain: its request, spec and tokens so far (prompt = the first num_prompt)."""

    row: int
    req_id: str
    spec: GrammarSpec
    token_ids: Sequence[int]
    num_prompt: int


class GrammarBook:
    """One matcher per constrained sequence, created on its first sampling step; `release` drops it."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self._matchers: dict[str, _Matcher] = {}
        # drafts a matcher was advanced over: by a verify step until `settle`, by drafting until `unwind`
        self._fed: dict[str, int] = {}
        self._unfed: set[str] = set()  # drafting stopped feeding these (a refused draft, a terminated matcher)

    def __len__(self) -> int:
        return len(self._matchers)

    def bitmask(self, rows: Sequence[ConstrainedRow], num_rows: int, device) -> tuple[Any, list[int]]:
        """(token bitmask [num_rows, words] on `device`, the row indices it applies to)."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(num_rows, self.cache.vocab_size)
        applied = []
        for r in rows:
            m = self._synced(r)
            if m.broken or m.matcher.is_terminated():
                continue
            m.matcher.fill_next_token_bitmask(mask, r.row)
            applied.append(r.row)
        return mask.to(device, non_blocking=True), applied

    def accept(self, req_id: str, token_id: int) -> None:
        m = self._matchers.get(req_id)
        if m is None or m.broken:
            return
        if not m.matcher.is_terminated() and not m.matcher.accept_token(token_id):
            m.broken = True
            log.error("request %s: the grammar refused token %d; no longer constraining it", req_id, token_id)
        m.accepted += 1

    def verify_bitmask(self, r: ConstrainedRow, drafts: Sequence[int], device) -> tuple[Any, list[int], int]:
        """A verify step of a constrained sequence (MTP, docs/mtp.md): (token bitmask [len(drafts) + 1, words] on
        `device`, the rows it applies to, m). Row i is the grammar's mask after the sequence's tokens and
        drafts[:i], as the step without speculation would fill it had they been emitted one by one; m = the
        leading drafts the grammar allows (rows past m are not filled: draft m, when m < len(drafts), is
        refused, so acceptance ends there). The matcher is left advanced over those m drafts until `settle`.
        Rows where the plain path does not constrain (the matcher terminated or broken) are left out, and a
        draft there is allowed, as the plain path's `accept` lets any token through."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(drafts) + 1, self.cache.vocab_size)
        m = self._synced(r)
        applied: list[int] = []
        allowed = fed = 0
        for i in range(len(drafts) + 1):
            free = m.broken or m.matcher.is_terminated()
            if not free:
                m.matcher.fill_next_token_bitmask(mask, i)
                applied.append(i)
            if i == len(drafts):
                break
            if not free:
                if not m.matcher.accept_token(drafts[i]):
                    break
                fed += 1
            allowed += 1
        self._fed[r.req_id] = fed
        return mask.to(device, non_blocking=True), applied, allowed

    def settle(self, req_id: str, num_accepted: int, token_id: int) -> None:
        """After `verify_bitmask`: roll the matcher back over the drafts it was advanced over and the verification
        rejected, count the accepted ones as accepted, then accept the token sampled after them."""
        fed = self._fed.pop(req_id, 0)
        m = self._matchers.get(req_id)
        if m is None:
            return
        if fed > num_accepted:  # the fed drafts are the leading ones: drafts[:fed]
            m.matcher.rollback(fed - num_accepted)
        m.accepted += num_accepted
        self.accept(req_id, token_id)

    def feed_draft(self, req_id: str, token_id: int) -> None:
        """Drafting (MTP): advance the matcher over a draft token so that the next draft's mask (`bitmask`)
        follows it; `unwind` undoes every fed draft. Nothing is fed once the matcher refused one, terminated or
        broke (the drafts after that are unconstrained; verification checks them all)."""
        m = self._matchers.get(req_id)
        if m is None or m.broken or req_id in self._unfed:
            return
        if m.matcher.is_terminated() or not m.matcher.accept_token(token_id):
            self._unfed.add(req_id)
            return
        self._fed[req_id] = self._fed.get(req_id, 0) + 1

    def unwind(self, req_id: str) -> None:
        """Roll the matcher back over the drafts `feed_draft` advanced it over."""
        fed = self._fed.pop(req_id, 0)
        self._unfed.discard(req_id)
        m = self._matchers.get(req_id)
        if m is not None and fed:
            m.matcher.rollback(fed)

    def release(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._fed.pop(req_id, None)
        self._unfed.discard(req_id)

    def _synced(self, r: ConstrainedRow) -> _Matcher:
        """The row's matcher, built if new and advanced over output tokens it has not accepted (the first
        token of a disaggregated decode, sampled by the prefill worker)."""
        import xgrammar as xgr

        m = self._matchers.get(r.req_id)
        if m is None:
            m = self._matchers[r.req_id] = _Matcher(xgr.GrammarMatcher(self.cache.compile(r.spec)))
        for i in range(r.num_prompt + m.accepted, len(r.token_ids)):
            self.accept(r.req_id, r.token_ids[i])
        return m
