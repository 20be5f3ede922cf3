"""Tokens as a client sees them: a streamed sample's text decoded a few tokens at a time (`Detokenizer`), and
each token's own bytes and text for logprobs (`TokenBytes`)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

NO_LOGPROB = -9999.0
"""Sent for a logprob that is not finite (-inf: an alternative top-p / top-k dropped), as vLLM does: JSON has
no infinity, and a bare `-Infinity` breaks strict parsers."""


@dataclass
class Detokenizer:
    """A streamed sample's text, decoded a few tokens at a time (as vLLM does): each step decodes the tokens
    since `prefix`, so the cost per step stays small however long the output, and a character split over
    tokens waits until it is whole. `sent` is what went to the client."""

    prefix: int = 0
    read: int = 0
    text: str = ""
    sent: str = ""

    def update(self, tokenizer: Any, ids: list[int], final: bool = False) -> None:
        """Decode the tokens since `read`; `final`: take what they decode to even if a character is cut."""
        if len(ids) <= self.read:
            return
        before = tokenizer.decode(ids[self.prefix : self.read], skip_special_tokens=True)
        after = tokenizer.decode(ids[self.prefix :], skip_special_tokens=True)
        whole = len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before)
        if whole or final:
            self.text += after[len(os.path.commonprefix([before, after])) :]
            self.prefix, self.read = self.read, len(ids)


def json_logprob(value: float) -> float:
    """A logprob JSON can hold: a non-finite one (-inf: dropped by top-p / top-k) becomes NO_LOGPROB."""
    return value if math.isfinite(value) else NO_LOGPROB


def token_text(token: bytes) -> str:
    """A token's text for logprobs: its bytes as UTF-8, where a byte that is part of a character the token
    holds only a piece of shows as `\\xNN` (as OpenAI's API does), not U+FFFD: so the pieces of different
    characters stay apart (completions' alternatives are keyed by their text) and none reads as a character."""
    return token.decode("utf-8", errors="backslashreplace")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed (the byte each of its characters stands for): printable bytes
    stand for themselves, the others, in order, for the characters from U+0100 (`bytes_to_unicode`)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    others = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}


BYTE_LEVEL = byte_level_alphabet()
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token's own bytes, from its vocabulary entry: decoding one token at a time turns a byte-level
    token that holds part of a multi-byte character into U+FFFD, losing the bytes logprobs' `bytes` exist
    to give. Byte-level BPE (GPT-2, Llama 3, Qwen): the entry's characters stand for bytes. SentencePiece:
    `<0xNN>` byte-fallback entries are that byte, `▁` a space. Anything else (added tokens, tokenizers of
    other kinds, entries outside the alphabet): the token decoded alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_kinds(tokenizer)
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        self.metaspace = "Metaspace" in kinds or "Replace▁" in kinds
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}

    def __call__(self, ids: list[int]) -> list[bytes]:
        if self.byte_level or self.byte_fallback or self.metaspace:
            pieces = list(self.tokenizer.convert_ids_to_tokens([int(t) for t in ids]))
        else:
            pieces = [None] * len(ids)
        return [self._one(int(t), piece) for t, piece in zip(ids, pieces)]

    def _one(self, token: int, piece: str | None) -> bytes:
        if token in self.added:
            return self.added[token].encode()
        if isinstance(piece, str) and piece:
            if self.byte_level and all(c in BYTE_LEVEL for c in piece):
                return bytes(BYTE_LEVEL[c] for c in piece)
            if self.byte_fallback and (match := BYTE_FALLBACK.fullmatch(piece)):
                return bytes([int(match.group(1), 16)])
            if self.metaspace and not self.byte_level:
                return piece.replace("\u2581", " ").encode()
        return str(self.tokenizer.decode([token])).encode()


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types in a fast tokenizer's decoder (a Sequence's too), "Replace▁" for a `▁` -> space Replace;
    empty where there is none to read (a slow tokenizer)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except Exception:  # a decoder that does not serialise: no shortcut, each token decoded alone
        return set()
    kinds: set[str] = set()
    stack = [spec]
    while stack:
        part = stack.pop()
        if not isinstance(part, dict):
            continue
        kinds.add(str(part.get("type")))
        if part.get("type") == "Replace" and part.get("pattern", {}).get("String") == "\u2581":
            kinds.add("Replace▁")
        stack += part.get("decoders") or []
    return kinds
