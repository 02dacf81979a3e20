"""Tokenizers: the model directory's ``tokenizer.json`` (``tokenizers`` package) or a built-in byte-level
tokenizer with the ChatML special tokens. Chat template: the model directory's (jinja, from
``tokenizer_config.json`` or ``chat_template.jinja``) when present, ChatML otherwise."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Protocol

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
# the tiny model's vision tokens (ids 260..263, ModelConfig.tiny()); Qwen2.5-VL / MiMo-V2.5 names
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_POSTAMBLE = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def chatml(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
           tools: list[dict[str, Any]] | None = None) -> str:
    """ChatML; with tools, in the Qwen2.5 / Hermes convention (tool definitions in the system message, calls as
    `<tool_call>\n{"name", "arguments"}\n</tool_call>`, tool results as `<tool_response>` in a user turn)."""
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    return _chatml_tools(messages, tools or [], add_generation_prompt)


def _chatml_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    parts = []
    if tools:
        system = messages[0]["content"] + "\n\n" if messages and messages[0]["role"] == "system" else ""
        defs = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        parts.append(f"<|im_start|>system\n{system}{TOOLS_PREAMBLE}{defs}{TOOLS_POSTAMBLE}<|im_end|>\n")
        if system:
            messages = messages[1:]
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            first = i == 0 or messages[i - 1]["role"] != "tool"
            last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
            parts.append(("<|im_start|>user" if first else "") + f"\n<tool_response>\n{m['content']}\n</tool_response>"
                         + ("<|im_end|>\n" if last else ""))
            continue
        body = m["content"]
        for call in m.get("tool_calls") or ():
            fn = call["function"]
            payload = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
            body += ("\n" if body else "") + f"<tool_call>\n{payload}\n</tool_call>"
        parts.append(f"<|im_start|>{m['role']}\n{body}<|im_end|>\n")
    return "".join(parts) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    special_tokens: dict[str, int]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str: ...


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _TemplateMixin:
    template: str | None = None
    special_tokens: dict[str, int]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt of a conversation; `tools` (OpenAI function tools) go to the template as `tools`, as HF
        templates expect (Qwen / MiMo templates render them into the system message); `template_kwargs` (e.g.
        `enable_thinking`) are the template's own variables."""
        if self.template is None:
            return chatml(messages, add_generation_prompt, tools)
        import jinja2  # only needed for model-provided templates

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson  # HF's tojson: plain JSON (jinja's escapes <, >, & and ' as HTML)
        return env.from_string(self.template).render(**template_kwargs, messages=messages, tools=tools or None,
                                                     add_generation_prompt=add_generation_prompt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ByteTokenizer(_TemplateMixin):
    """ids 0..255 are raw UTF-8 bytes; ChatML specials follow at 256.., then the vision specials (recognised
    inside text)."""

    def __init__(self, template: str | None = None) -> None:
        specials = CHATML_SPECIALS + VISION_SPECIALS
        self.special_tokens = {tok: 256 + i for i, tok in enumerate(specials)}
        self._by_id = {v: k for k, v in self.special_tokens.items()}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in specials) + ")")
        self.eos_token_ids: tuple[int, ...] = (self.special_tokens["<|im_end|>"],
                                               self.special_tokens["<|endoftext|>"])
        self.template = template
        self.vocab_size = 256 + len(specials)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.special_tokens:
                ids.append(self.special_tokens[part])
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens and i in self._by_id:
                out.append(self._by_id[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes: one byte for ids < 256 (also 128-255, which are not text on their own)."""
        if 0 <= token_id < 256:
            return bytes([token_id])
        return self._by_id.get(token_id, "").encode()


class HFTokenizer(_TemplateMixin):
    def __init__(self, path: Path, template: str | None, eos: tuple[int, ...]) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path / "tokenizer.json"))
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}
        # Checkpoints whose tokenizer.json lists e.g. <|im_start|> as a plain added token but whose
        # tokenizer_config.json calls it special: `tokenizers` would keep it in skip_special_tokens text.
        configured = _configured_specials(path)
        self._extra_special = {i for i, t in added.items() if not t.special and t.content in configured}
        self.special_tokens |= {added[i].content: i for i in self._extra_special}
        if not eos:
            eos = tuple(self.special_tokens[t] for t in ("<|im_end|>", "<|endoftext|>") if t in self.special_tokens)
        self.eos_token_ids = eos
        self.template = template
        self.vocab_size = self._tok.get_vocab_size()
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._byte_level = '"ByteLevel"' in json.dumps(json.loads(self._tok.to_str()).get("decoder"))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens and self._extra_special:
            ids = [i for i in ids if i not in self._extra_special]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes: byte-level BPE pieces mapped back to bytes, `<0xNN>` byte-fallback
        pieces as that byte, sentencepiece's '▁' as a space; added tokens as their text."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


def _template_from(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = path / "tokenizer_config.json"
    if cfg.is_file():
        tpl = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(tpl, str):
            return tpl
    return None


def _configured_specials(path: Path) -> set[str]:
    """Tokens tokenizer_config.json calls special (added_tokens_decoder, additional_special_tokens,
    bos/eos/pad/unk), as strings."""
    f = path / "tokenizer_config.json"
    if not f.is_file():
        return set()
    cfg = json.loads(f.read_text())

    def content(t: Any) -> str | None:
        return t.get("content") if isinstance(t, dict) else t if isinstance(t, str) else None

    names = [content(t) for t in cfg.get("added_tokens_decoder", {}).values()
             if isinstance(t, dict) and t.get("special")]
    names += [content(t) for t in cfg.get("additional_special_tokens") or []]
    names += [content(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")]
    return {n for n in names if n}


def _eos_from(path: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


def load_tokenizer(path: str | None) -> Tokenizer:
    """``tokenizer.json`` from ``path`` if present, else the byte-level tokenizer (``path=None``: built-in)."""
    if path is None:
        return ByteTokenizer()
    root = Path(path)
    template = _template_from(root)
    if (root / "tokenizer.json").is_file():
        return HFTokenizer(root, template, _eos_from(root))
    return ByteTokenizer(template)
