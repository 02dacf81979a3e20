"""Reasoning output: the `<think>…</think>` a MiMo-V2 (or Qwen3-style) model writes before its answer, split from
the answer as OpenAI-compatible servers return it (`reasoning_content` beside `content`).

On for chat when the model's chat template knows the tags. The text is split as it streams: a piece that could be
the start of a tag is held back until the next one decides, so no tag text ever reaches either side.
"""

from __future__ import annotations

from libs.engine.grammar import THINK_CLOSE as CLOSE
from libs.engine.grammar import THINK_OPEN as OPEN


def reasoning_mode(template: str | None, prompt: str) -> str | None:
    """None: no reasoning split (the template does not know the tags); "open": the prompt already opened the
    reasoning (the template ends the generation prompt with `<think>`); "detect": the output may open it."""
    if not template or CLOSE not in template:
        return None
    return "open" if prompt.rstrip().endswith(OPEN) else "detect"


def grammar_reasoning(mode: str | None, prompt: str) -> str:
    """How a constrained answer (JSON, tool calls) follows the reasoning, as `WireGrammar.reasoning`: after the
    reasoning the prompt opened ("open"), after one the output may open ("detect"), or from the first token
    ("": no reasoning, or the prompt already closed it: the template's switch turned thinking off)."""
    if mode is None or prompt.rstrip().endswith(CLOSE):
        return ""
    return mode


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (it may be completed next)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """Feeds output text in pieces; each `feed` returns the (reasoning, content) text it can release now."""

    def __init__(self, mode: str) -> None:
        self.state = "thinking" if mode == "open" else "start"
        self._buf = ""
        self._after_close = False  # the blank lines between `</think>` and the answer are dropped
        self.reasoning = ""  # all released so far
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        if self.state == "start":
            head = self._buf.lstrip()
            if head.startswith(OPEN):
                self.state, self._buf = "thinking", head[len(OPEN):]
            elif OPEN.startswith(head):
                return "", ""  # (blank, or part of the tag: wait)
            else:
                self.state = "content"
        if self.state == "thinking":
            end = self._buf.find(CLOSE)
            if end < 0:
                keep = _held_suffix(self._buf, CLOSE)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            else:
                reasoning, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
                self.state, self._after_close = "content", True
        if self.state == "content":
            if self._after_close:
                self._buf = self._buf.lstrip()
                self._after_close = not self._buf
            content, self._buf = self._buf, ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back: reasoning left open, or the start of an answer that never became a tag."""
        rest, self._buf = self._buf, ""
        if self.state == "thinking":
            self.reasoning += rest
            return rest, ""
        self.content += rest
        return "", rest
