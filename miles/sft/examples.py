"""SFT examples: a row's reference answer (or a conversation's assistant turns) as the response to train on,
written the way the model's chat template closes an assistant turn, and cut to the model's context."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from miles.data import PromptFormatter
from miles.errors import MilesUserError
from miles.models.tokenizer import special_tokens
from miles.sample import Sample

log = logging.getLogger("miles.sft")


@dataclass(frozen=True)
class TurnEnd:
    """How the chat template closes an assistant turn."""

    suffix: str
    """What it writes after an assistant message's content (`<|im_end|>\\n` in ChatML)."""
    end: str
    """The part of `suffix` the assistant writes: through its first special token, the end-of-turn token
    (`<|im_end|>`; the newline after it is the template's, as in transformers' assistant mask)."""
    token: str
    """The end-of-turn token."""


_PROBE = "\x00miles-sft-probe\x00"


def chat_turn_end(formatter: PromptFormatter) -> TurnEnd | None:
    """How `formatter`'s chat template ends an assistant turn; None where prompts are not chat-formatted or
    the template writes no special token after the content (a plain-text format: eos ends the response)."""
    if formatter.cfg.prompt_template is not None or not formatter.use_chat_template:
        return None
    tokenizer = formatter.tokenizer
    messages = formatter.messages("x")
    try:
        opened = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        closed = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": _PROBE}], tokenize=False
        )
    except Exception:  # a template that cannot close a turn on its own (it raises on this conversation)
        return None
    if not closed.startswith(opened) or _PROBE not in closed:
        return None
    suffix = closed[closed.index(_PROBE) + len(_PROBE) :]
    found = [(suffix.find(t), t) for t in set(special_tokens(tokenizer).values()) if t and t in suffix]
    if not found:
        return None
    at, token = min(found, key=lambda f: (f[0], -len(f[1])))
    return TurnEnd(suffix=suffix, end=suffix[: at + len(token)], token=token)


def _ids(tokenizer: object, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def _segment_ids(tokenizer: object, text: str, cuts: list[int]) -> list[list[int]]:
    """Token ids of text[cuts[i]:cuts[i + 1]] as they come out of tokenizing the text up to each cut (so a
    segment is tokenized after what precedes it, as in the whole conversation); each segment on its own where
    a later cut would re-tokenize an earlier segment."""
    before = _ids(tokenizer, text[: cuts[0]])
    out = []
    for cut in cuts[1:]:
        upto = _ids(tokenizer, text[:cut])
        if upto[: len(before)] != before:
            return [_ids(tokenizer, text[a:b]) for a, b in zip(cuts, cuts[1:])]
        out.append(upto[len(before) :])
        before = upto
    return out


def _assistant_turns(
    formatter: PromptFormatter, turn: TurnEnd, messages: list[dict[str, Any]], first: int
) -> tuple[list[int], list[int], list[int]] | None:
    """(prompt ids, response ids, loss mask) of a conversation whose messages from `first` on are trained:
    the prompt is the template's text up to the content of message `first` (an assistant turn), the response
    the rest through the last assistant turn's end-of-turn token, with the loss on the assistant's turns
    (content and end-of-turn token) only. None where the template does not render the conversation turn by
    turn (an earlier turn rendered alone differs from its part of the whole)."""
    tokenizer = formatter.tokenizer
    render = tokenizer.apply_chat_template  # type: ignore[attr-defined]
    whole = render(messages, tokenize=False)
    cuts: list[int] = []
    for i in range(first, len(messages)):
        if messages[i].get("role") != "assistant":
            continue
        opened = render(messages[:i], tokenize=False, add_generation_prompt=True)
        closed = render(messages[: i + 1], tokenize=False)
        if not (whole.startswith(opened) and whole.startswith(closed) and closed.endswith(turn.suffix)):
            return None
        start, end = len(opened), len(closed) - len(turn.suffix) + len(turn.end)
        if cuts and start < cuts[-1]:
            return None
        cuts += [start, end]
    if not cuts:
        return None
    segments = _segment_ids(tokenizer, whole, [0, *cuts])
    prompt, response, mask = segments[0], [], []
    for k, ids in enumerate(segments[1:]):
        response += ids
        mask += [1 if k % 2 == 0 else 0] * len(ids)  # assistant turn, then what lies before the next one
    return prompt, response, mask


def sft_samples(
    prompts: list[Sample], tokenizer: object, eos_id: int, formatter: PromptFormatter | None = None
) -> list[Sample]:
    """Attach the reference solution (metadata solution / response, else the label) as the response.

    With a chat template (`formatter`'s) the response is the assistant's turn as the template writes it, through
    its end-of-turn token (transformers' assistant mask, what TRL's SFTTrainer trains with
    `assistant_only_loss`), whatever the tokenizer's eos; without one, the solution and eos. A row whose
    messages end with the assistant's turn and that has no solution / response column is a conversation to
    learn: with a chat template every assistant turn is trained and the other turns are masked; without one,
    its last message is the response to the messages before it."""
    turn = chat_turn_end(formatter) if formatter is not None else None
    out, fallbacks = [], 0
    for p in prompts:
        target = p.metadata.get("solution") or p.metadata.get("response")
        messages = (
            formatter.messages(p.prompt) if formatter is not None and isinstance(p.prompt, list) else None
        )
        conversation = target is None and messages is not None and messages[-1].get("role") == "assistant"
        if conversation and turn is not None and formatter is not None and messages is not None:
            first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
            built = _assistant_turns(formatter, turn, messages, first)
            if built is None:
                raise MilesUserError(
                    "SFT on a conversation needs a chat template that renders it turn by turn (each turn's text "
                    "the same alone as in the whole conversation); this one does not: give each row a prompt "
                    "and a `response` column instead"
                )
            prompt_ids, ids, mask = built
            out.append(
                Sample(
                    prompt=p.prompt,
                    prompt_ids=prompt_ids,
                    response_ids=ids,
                    response_text=str(messages[-1].get("content", "")),
                    loss_mask=mask,
                    label=p.label,
                    metadata=p.metadata,
                )
            )
            continue
        prompt_ids = p.prompt_ids
        if conversation and formatter is not None and messages is not None and isinstance(p.prompt, list):
            # no chat template: the last message answers the ones before it
            target = messages[-1].get("content", "")
            prompt_ids = formatter.ids(p.prompt[:-1])
        if target is None:
            if p.label is None:
                raise MilesUserError("SFT needs a `solution`/`response` column or a label in every data row")
            target = f"#### {p.label}"
        ids = _response_ids(formatter, turn, p, prompt_ids, str(target))
        if ids is None:
            fallbacks += turn is not None
            ids = _ids(tokenizer, str(target)) + [eos_id]
        out.append(
            Sample(
                prompt=p.prompt,
                prompt_ids=prompt_ids,
                response_ids=ids,
                response_text=str(target),
                loss_mask=[1] * len(ids),
                label=p.label,
                metadata=p.metadata,
            )
        )
    if fallbacks:
        log.warning(
            "SFT: the chat template did not close %d of %d assistant turns as it closes others (%r); those "
            "responses end with eos instead",
            fallbacks,
            len(prompts),
            turn.suffix if turn is not None else "",
        )
    return out


def _response_ids(
    formatter: PromptFormatter | None, turn: TurnEnd | None, p: Sample, prompt_ids: list[int], target: str
) -> list[int] | None:
    """The assistant turn answering `p` with `target` as the chat template writes it, through its end-of-turn
    token, tokenized after the prompt; None without a chat template (or one that does not close the turn with
    its usual suffix here)."""
    if formatter is None or turn is None:
        return None
    tokenizer = formatter.tokenizer
    messages = formatter.messages(p.prompt)
    opened = formatter.text(p.prompt)
    closed = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [*messages, {"role": "assistant", "content": target}], tokenize=False
    )
    if not closed.startswith(opened) or not closed.endswith(turn.suffix):
        return None
    text = closed[: len(closed) - len(turn.suffix)] + turn.end
    whole = _ids(tokenizer, text)
    if whole[: len(prompt_ids)] == list(prompt_ids):
        return whole[len(prompt_ids) :]
    return _ids(tokenizer, text[len(opened) :])


def fit_context(samples: list[Sample], context_length: int) -> tuple[list[Sample], dict[str, float]]:
    """Examples cut to the model's context: a prompt and response longer than `context_length` tokens keep the
    prompt and the response's start (TRL's `keep_start`; the cut response ends without its end-of-turn token),
    an example whose prompt alone fills the context is left out. Returns the examples and
    `data/sft_truncated_responses`, `data/sft_dropped_examples` (logged in the run's first record)."""
    kept, truncated, dropped = [], 0, 0
    for s in samples:
        room = context_length - len(s.prompt_ids)
        if room < 1:
            dropped += 1
            continue
        if len(s.response_ids) > room:
            truncated += 1
            s = replace(s, response_ids=s.response_ids[:room], loss_mask=s.loss_mask[:room])
        kept.append(s)
    if truncated or dropped:
        log.warning(
            "SFT: %d of %d examples are longer than the model's context (%d tokens): %d cut to it (the "
            "response's end goes), %d left out (the prompt alone fills it)",
            truncated + dropped,
            len(samples),
            context_length,
            truncated,
            dropped,
        )
    return kept, {
        "data/sft_truncated_responses": float(truncated),
        "data/sft_dropped_examples": float(dropped),
    }


def end_of_turn_id(formatter: PromptFormatter) -> int | None:
    """The id of the token the chat template ends an assistant turn with; None without one."""
    turn = chat_turn_end(formatter)
    end_id = None if turn is None else formatter.tokenizer.convert_tokens_to_ids(turn.token)
    return end_id if isinstance(end_id, int) else None


def end_of_turn_stops(formatter: PromptFormatter, args: Any, stops: list[int]) -> list[int]:
    """`stops` and the chat template's end-of-turn token, which SFT teaches the model to end its turns with:
    where the tokenizer's eos is another token (a base model's `<|endoftext|>` beside ChatML's `<|im_end|>`),
    the eval stops there too, and the model's `eos_token_id` (`args`, its config.json in the checkpoints)
    gains it, so that a run from an SFT checkpoint stops there as well."""
    end_id = end_of_turn_id(formatter)
    if end_id is None or end_id in stops:
        return stops
    args.eos_token_id = sorted({*args.eos_token_ids, end_id})
    return sorted({*stops, end_id})
