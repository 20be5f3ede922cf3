"""The character tokenizer: round trip, special tokens, Qwen-style chat template, offline loading."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miles.errors import MilesUserError
from miles.models.tokenizer import (
    CHARACTERS,
    SPECIAL_TOKENS,
    char_tokenizer,
    char_vocab_size,
    load_tokenizer,
    save_char_tokenizer,
)

PROBLEM = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\n"
    "How many clips did Natalia sell altogether? 48/2 = 24; 48+24 = 72 (x*y - 3) = $5.50 \\boxed{72} #### 72"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"))


@pytest.fixture(scope="module")
def tok(saved: Path):
    return load_tokenizer(saved)


def test_vocabulary_covers_printable_ascii_and_newline() -> None:
    assert set(string.printable) - set(CHARACTERS) == {"\t", "\r", "\x0b", "\x0c"}
    assert len(set(SPECIAL_TOKENS + CHARACTERS)) == char_vocab_size() == len(char_tokenizer())


def test_round_trip_one_token_per_character(tok) -> None:
    ids = tok(PROBLEM, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(PROBLEM)  # no BOS prepended, no merges
    assert tok.decode(ids) == PROBLEM
    assert tok.convert_ids_to_tokens(tok.encode("12 + 7")) == ["1", "2", " ", "+", " ", "7"]
    every_char = "".join(CHARACTERS)
    assert tok.decode(tok.encode(every_char)) == every_char


def test_special_tokens(tok) -> None:
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<pad>" and tok.unk_token == "<unk>"
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.bos_token is None
    for special in SPECIAL_TOKENS:
        assert tok.encode(special) == [tok.convert_tokens_to_ids(special)]
    text = "<|im_start|>assistant\n42<|im_end|><|endoftext|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "assistant\n42"
    assert tok.decode(tok.encode("3 × 4 ≠ π")) == "3 <unk> 4 <unk> <unk>"


def test_chat_template(tok) -> None:
    messages = [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2*3?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2*3?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tok.encode(text)
    without = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    assert without == "<|im_start|>system\nSolve it.<|im_end|>\n"


def test_autotokenizer_loads_offline(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    auto = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    reference = char_tokenizer()
    assert auto.encode(PROBLEM) == reference.encode(PROBLEM)
    assert auto.chat_template == reference.chat_template
    assert {p.name for p in saved.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(MilesUserError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(MilesUserError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(MilesUserError, match="could not load the tokenizer"):
        load_tokenizer(tmp_path)
