"""A request's prompt as token ids, and why the engine would refuse it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.sample import Sample


def prompt_token_ids(prompt: Sample | list[int] | str, tokenizer: Any | None) -> list[int]:
    """A new list of Python ints (ids may come as numpy or torch scalars): a Sample's `prompt_ids`, else its
    chat messages through the chat template; a text through the tokenizer; ids as they are."""
    if isinstance(prompt, Sample):
        if prompt.prompt_ids:
            return [int(t) for t in prompt.prompt_ids]
        prompt = prompt.prompt  # type: ignore[assignment]
        if isinstance(prompt, list):
            if tokenizer is None:
                raise ValueError("chat-message prompts need a tokenizer (or fill Sample.prompt_ids)")
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding here, 4.x a list
                ids = ids["input_ids"]
            return [int(t) for t in ids]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids or give Engine a tokenizer")
        return [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    return [int(t) for t in prompt]


def prompt_problem(ids: list[int], vocab_size: int, max_context: int, capacity_tokens: int) -> str | None:
    """Why a prompt cannot be generated from (None: it can): empty, a token outside the vocabulary, no room
    left in the context (`max_context`) or longer than the KV pool (`capacity_tokens`)."""
    if not ids:
        return "empty prompt: a request needs at least one prompt token"
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        return f"prompt token id {bad} is outside the model's vocabulary [0, {vocab_size})"
    if len(ids) + 1 > max_context:
        return (
            f"prompt has {len(ids)} tokens but the context is {max_context} tokens "
            "(max_position_embeddings, YaRN's factor, rollout.max_context), so no token can be generated; "
            "drop or truncate long prompts (data.max_prompt_length)"
        )
    if len(ids) > capacity_tokens:
        return (
            f"prompt has {len(ids)} tokens but the KV pool holds only {capacity_tokens}; raise "
            "rollout.kv_cache_bytes (CPU) / rollout.kv_cache_fraction (GPU) or drop long prompts"
        )
    return None
