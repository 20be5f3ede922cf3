"""Stop strings (rollout/outputs.py) whose text is a special token's: "<|endoftext|>", or a "</think>" that a
tokenizer marks special. They are matched in the text with special tokens kept (as SGLang decodes its stop
check's tail), so they stop when that token is generated; the response text still leaves special tokens out
(as without a stop string) and ends before the stop string."""

from __future__ import annotations

from typing import Any

import pytest

from miles.models.tokenizer import char_tokenizer
from miles.rollout import Engine, SamplingParams
from miles.rollout.outputs import finish_status, hit_stop_string
from miles.rollout.request import Request
from miles.sample import SampleStatus
from tests.support.models import rollout_config, tiny_model


@pytest.fixture(scope="module")
def chars() -> Any:
    """One token a character; `<|endoftext|>` and `<|im_start|>` are special tokens missing from
    `all_special_ids` (as Qwen's `<|endoftext|>` is), which `decode(skip_special_tokens=True)` still drops."""
    return char_tokenizer()


@pytest.fixture(scope="module")
def byte_bpe() -> Any:
    """A byte-level BPE (a character may take several tokens, a token several characters) with `</think>` a
    special token and `<tool_call>` an added token that is not special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_end|>", "<|endoftext|>"],
    )
    backend.train_from_iterator(["all done, the answer is 42 and that is all"] * 10, trainer)
    backend.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    backend.add_special_tokens([AddedToken("</think>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", clean_up_tokenization_spaces=False
    )


def special(tokenizer: Any, text: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(text))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def run(tokenizer: Any, ids: list[int], stop: list[str]) -> tuple[int, str | None]:
    """Feeds `ids` one token at a time, as the engine checks them; (tokens when it stopped, else 0; the text)."""
    req = Request(rid=0, prompt_ids=[5], params=SamplingParams(stop=stop), seed=0)
    for token in ids:
        req.output_ids.append(token)
        if hit_stop_string(req, tokenizer):
            return len(req.output_ids), req.stop_text
    return 0, None


@pytest.mark.parametrize("name", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
def test_a_special_token_s_text_stops_when_that_token_is_generated(chars: Any, name: str) -> None:
    ids = [*encode(chars, "ab"), special(chars, name), *encode(chars, "cd")]
    assert run(chars, ids, [name]) == (3, "ab")
    req = Request(rid=0, prompt_ids=[5], params=SamplingParams(stop=["zz", name]), seed=0, output_ids=ids[:3])
    assert finish_status(req, set(), 1000, chars) == SampleStatus.COMPLETED and req.stop_text == "ab"


def test_text_and_special_tokens_in_one_stop_string(byte_bpe: Any) -> None:
    think = special(byte_bpe, "</think>")
    ids = [*encode(byte_bpe, "all done"), think, *encode(byte_bpe, " the answer")]
    assert run(byte_bpe, ids, ["done</think>"])[1] == "all "
    assert run(byte_bpe, ids, ["ne</think>"])[1] == "all do"  # the stop string starts inside a token
    assert run(byte_bpe, ids, ["</think> the"])[1] == "all done"
    assert run(byte_bpe, ids, ["k> the"])[1] == "all done"  # starts inside the special token: it is left out
    # A character of several tokens just before the stop string.
    ids = [*encode(byte_bpe, "答"), think]
    assert len(ids) > 2 and run(byte_bpe, ids, ["</think>"]) == (len(ids), "答")


def test_special_tokens_before_the_stop_are_left_out_but_their_text_spelled_out_stays(chars: Any) -> None:
    """The text is the tokens' own: a special token before the stop string is left out (as without stop
    strings), while the same text spelled in ordinary tokens is kept."""
    eot, start = special(chars, "<|endoftext|>"), special(chars, "<|im_start|>")
    spelled = [t for c in "<|endoftext|>" for t in encode(chars, c)]  # ordinary characters
    ids = [*encode(chars, "x"), eot, *encode(chars, "y"), *spelled, start, *encode(chars, "z")]
    assert run(chars, ids, ["<|im_start|>"]) == (len(ids) - 1, "xy<|endoftext|>")


def test_stop_strings_of_plain_text_and_added_tokens_still_match(byte_bpe: Any, chars: Any) -> None:
    ids = [*encode(byte_bpe, "the answer <tool_call> is 42")]
    assert run(byte_bpe, ids, ["<tool_call>"])[1] == "the answer "
    assert run(byte_bpe, ids, ["is 4"])[1] == "the answer <tool_call> "
    # In the text users get (special tokens left out) a stop string may span a special token, as before.
    ids = [*encode(chars, "abc"), special(chars, "<|endoftext|>"), *encode(chars, "def")]
    assert run(chars, ids, ["cd"]) == (5, "ab")


def test_a_long_output_finds_a_stop_string_through_its_sliding_window(byte_bpe: Any) -> None:
    think, end = special(byte_bpe, "</think>"), special(byte_bpe, "<|im_end|>")
    text = "that is all, the answer is 42 " * 8
    ids = [*encode(byte_bpe, text), think, *encode(byte_bpe, "and"), end, *encode(byte_bpe, "x")]
    assert run(byte_bpe, ids, ["</think>and<|im_end|>"]) == (len(ids) - 1, text)
    assert run(byte_bpe, ids, ["42 </think>"]) == (len(encode(byte_bpe, text)) + 1, text[:-3])


def config(**overrides: object):  # noqa: ANN201
    return rollout_config(dict(kv_cache_bytes=4 * 1024 * 1024, max_batch_tokens=256), overrides)


@pytest.mark.usefixtures("overlap_mode")
def test_the_engine_stops_at_a_generated_special_token(chars: Any) -> None:
    """Seeded draws do not depend on the stop strings, so the stopped samples are the free ones cut at the
    first special token named by a stop string (the text before it, special tokens left out)."""
    engine = Engine(tiny_model(vocab_size=len(chars)), chars, config())
    params = SamplingParams(n=8, temperature=1.5, max_new_tokens=40, seed=5, ignore_eos=True)
    prompt = encode(chars, "12+7=")
    free = engine.generate([prompt], params)
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    stops = {special(chars, name) for name in names}
    stopped = engine.generate([prompt], params.with_(stop=names))
    hits = 0
    for ref, s in zip(free, stopped, strict=True):
        at = next((i for i, t in enumerate(ref.response_ids) if t in stops), None)
        if at is None:
            assert s.response_ids == ref.response_ids and s.status == SampleStatus.TRUNCATED
            continue
        hits += 1
        assert s.status == SampleStatus.COMPLETED and s.response_ids == ref.response_ids[: at + 1]
        assert s.response_text == chars.decode(ref.response_ids[:at], skip_special_tokens=True)
    assert hits >= 2, "the seed should draw special tokens in some samples"
