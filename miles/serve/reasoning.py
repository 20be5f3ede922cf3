"""`miles serve --reasoning-parser qwen3`: a thinking model's `<think>...</think>` as `reasoning_content`.

Qwen3 (and DeepSeek-R1-style) models think first: `<think>\\n...\\n</think>\\n\\n` and then the answer. With
the parser on, a chat reply that starts thinking is split: the text inside the tags is the message's
`reasoning_content`, what follows (less its leading whitespace) its `content`, in which tool calls are then
looked for (tools.py). A reply starts thinking when its text opens with `<think>`, or when the prompt
already ended with it (templates that open the thinking block themselves, as Qwen3's thinking-only releases
do). A reply cut off while thinking is all reasoning, with empty content. Any other reply is all content,
whatever tags it holds later. Streaming sends `reasoning_content` deltas while the model thinks and
`content` deltas after, holding back only what may be part of a tag; the pieces add up to the non-streamed
split (`ReasoningStream`).
"""

from __future__ import annotations

from miles.serve.tools import partial_tag

THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str, thinking: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a reply; `thinking`: the prompt ended inside `<think>`."""
    head = text.lstrip()
    if head.startswith(THINK_START):
        head = head[len(THINK_START) :]
    elif not thinking:
        return None, text
    end = head.find(THINK_END)
    if end < 0:
        return head.strip(), ""
    return head[:end].strip(), head[end + len(THINK_END) :].lstrip()


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a thinking block (its template opened it)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_START)


class ReasoningStream:
    """One streamed choice's split: `feed` returns (new reasoning, new content) that can go out now, `finish`
    the rest; the pieces add up to `split_reasoning` of the whole text."""

    def __init__(self, thinking: bool = False) -> None:
        self.text, self.thinking = "", thinking
        self.sent_reasoning = self.sent_content = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        head = self.text.lstrip()
        if len(head) < len(THINK_START) and THINK_START.startswith(head):
            return "", ""  # may still be the opening tag
        reasoning, content = split_reasoning(self._safe(), self.thinking)
        if reasoning is None:  # plain content from here on: nothing to hold back
            return self._send(None, self.text)
        return self._send(reasoning, content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) not sent yet, of the whole text."""
        return self._send(*split_reasoning(self.text, self.thinking))

    def _safe(self) -> str:
        """The text less a tail that may be the start of `</think>`."""
        return self.text[: len(self.text) - partial_tag(self.text, THINK_END)]

    def _send(self, reasoning: str | None, content: str) -> tuple[str, str]:
        reasoning = reasoning or ""
        assert reasoning.startswith(self.sent_reasoning) and content.startswith(self.sent_content), (
            reasoning,
            content,
        )
        new = reasoning[len(self.sent_reasoning) :], content[len(self.sent_content) :]
        self.sent_reasoning, self.sent_content = reasoning, content
        return new
