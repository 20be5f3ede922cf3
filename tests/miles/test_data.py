from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles import synthetic_math
from miles.config import DataConfig
from miles.data import PromptFormatter, PromptLoader, load_rows, to_samples
from miles.errors import MilesUserError


class WordTokenizer:
    """Whitespace tokenizer with no chat template (exercises the plain-text path)."""

    chat_template = None
    eos_token_id = 0

    def __call__(self, text: str | list[str], add_special_tokens: bool = False) -> dict[str, list]:
        if isinstance(text, list):
            return {"input_ids": [[len(w) for w in t.split()] for t in text]}
        return {"input_ids": [len(w) for w in text.split()]}


def test_synthetic_math_is_deterministic_and_correct() -> None:
    a = synthetic_math.generate(50, seed=3)
    b = synthetic_math.generate(50, seed=3)
    assert a == b
    for problem in synthetic_math.generate(200, seed=1, difficulty="medium"):
        assert problem.solution.endswith(f"#### {problem.answer}")
        assert problem.answer >= 0
        lhs = problem.solution.split("####")[0].split(",")[-1].split("=")[0]
        assert eval(lhs) == problem.answer  # noqa: S307 - our own generated arithmetic


def test_train_and_test_splits_are_disjoint() -> None:
    train, test = synthetic_math.splits(2000, 200, seed=0, difficulty="easy")
    assert len(test) == 200 and len(train) == 2000
    assert not {p.question for p in train} & {p.question for p in test}


def test_jsonl_and_verl_parquet(tmp_path: Path) -> None:
    import pandas as pd

    rows = [
        {
            "prompt": [{"role": "user", "content": "What is 2+2?"}],
            "data_source": "openai/gsm8k",
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"index": 0},
        },
        {
            "prompt": [{"role": "user", "content": "What is 3+3?"}],
            "data_source": "openai/gsm8k",
            "reward_model": {"style": "rule", "ground_truth": "6"},
            "extra_info": {"index": 1},
        },
    ]
    parquet = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(parquet)
    train, test = load_rows(DataConfig(path=str(parquet)))
    assert [r.label for r in train] == ["4", "6"] and test == []
    assert train[0].metadata["data_source"] == "openai/gsm8k"
    assert train[0].prompt[0]["content"] == "What is 2+2?"

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) for i in range(3)))
    train, _ = load_rows(DataConfig(path=str(jsonl)))
    assert [r.label for r in train] == ["0", "1", "2"]


def test_bad_data_inputs(tmp_path: Path) -> None:
    with pytest.raises(MilesUserError, match="does not exist"):
        load_rows(DataConfig(path=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "d.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(MilesUserError, match="prompt_key"):
        load_rows(DataConfig(path=str(bad)))
    with pytest.raises(MilesUserError, match="unknown data.source"):
        load_rows(DataConfig(source="nope"))


def test_long_prompts_are_dropped_and_counted() -> None:
    cfg = DataConfig(train_size=20, test_size=5, max_prompt_length=12)
    train, _ = load_rows(cfg)
    train[0].prompt = "word " * 50
    samples, dropped = to_samples(train, PromptFormatter(WordTokenizer(), cfg), cfg.max_prompt_length)
    assert dropped >= 1 and len(samples) == len(train) - dropped


def test_prompt_template_and_loader() -> None:
    cfg = DataConfig(prompt_template="Q: {prompt}\nA:")
    fmt = PromptFormatter(WordTokenizer(), cfg)
    assert fmt.text("hi there") == "Q: hi there\nA:"
    rows, _ = load_rows(DataConfig(train_size=10, test_size=2))
    samples, _ = to_samples(rows, fmt, 1000)
    loader = PromptLoader(samples, batch_size=4, shuffle=True, seed=0)
    seen = [s.prompt for _ in range(5) for s in loader.next_batch()]
    assert len(seen) == 20 and set(seen) == {s.prompt for s in samples}


def _save_dataset_dict(path: Path, splits: list[str]) -> str:
    import datasets

    datasets.disable_progress_bars()
    dd = datasets.DatasetDict(
        {name: datasets.Dataset.from_list([{"prompt": f"{name} q", "label": "1"}]) for name in splits}
    )
    dd.save_to_disk(str(path))
    return str(path)


def test_a_saved_dataset_dict_as_eval_path_reads_its_test_split(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from miles.data import load_eval_rows

    folder = _save_dataset_dict(tmp_path / "dd", ["train", "validation", "test"])
    with caplog.at_level("INFO", logger="miles.data"):
        train, test = load_rows(DataConfig(path=folder, eval_path=folder))
    assert [r.prompt for r in train] == ["train q"] and [r.prompt for r in test] == ["test q"]
    assert "reading split 'test'" in caplog.text
    # `miles eval --data DIR` reads only the held-out split
    assert [r.prompt for r in load_eval_rows(DataConfig(source="file", path=folder, eval_path=folder))] == [
        "test q"
    ]

    no_test = _save_dataset_dict(tmp_path / "dd2", ["train", "validation"])
    assert [r.prompt for r in load_rows(DataConfig(path=no_test, eval_path=no_test))[1]] == ["validation q"]

    only_train = _save_dataset_dict(tmp_path / "dd3", ["train"])
    with caplog.at_level("WARNING", logger="miles.data"):
        assert [r.prompt for r in load_rows(DataConfig(path=only_train, eval_path=only_train))[1]] == [
            "train q"
        ]
    assert "has no 'test' / 'validation' split" in caplog.text


def test_dir_colon_split_picks_a_split(tmp_path: Path) -> None:
    folder = _save_dataset_dict(tmp_path / "dd", ["train", "validation", "test"])
    train, test = load_rows(DataConfig(path=f"{folder}:validation", eval_path=f"{folder}:train"))
    assert [r.prompt for r in train] == ["validation q"] and [r.prompt for r in test] == ["train q"]
    with pytest.raises(
        MilesUserError, match=r"no split 'dev'; the dataset has \['test', 'train', 'validation'\]"
    ):
        load_rows(DataConfig(path=f"{folder}:dev"))


def test_eval_path_gives_the_held_out_rows_of_any_source(tmp_path: Path) -> None:
    """Training on synthetic math, evaluating on a file: data.eval_path is read, not the synthetic test
    split (and `miles eval`'s rows are the same)."""
    from miles.data import load_eval_rows

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"prompt": "What is 2+2?", "label": "4"}) + "\n")
    cfg = DataConfig(train_size=20, test_size=5, eval_path=str(held_out))
    train, test = load_rows(cfg)
    assert len(train) == 20 and train[0].metadata["data_source"] == "synthetic_math"
    assert [(row.prompt, row.label) for row in test] == [("What is 2+2?", "4")]
    assert [row.prompt for row in load_eval_rows(cfg)] == ["What is 2+2?"]
    assert len(load_rows(DataConfig(train_size=20, test_size=5))[1]) == 5  # no eval_path: the synthetic split


def test_an_unknown_synthetic_difficulty_is_a_user_error() -> None:
    with pytest.raises(MilesUserError, match="easy or medium"):
        load_rows(DataConfig(train_size=4, test_size=2, difficulty="hard"))


def test_a_prompt_template_with_another_field_is_a_user_error() -> None:
    """`{question}` (a column name, as other frameworks template) stops with what the template takes."""
    formatter = PromptFormatter(WordTokenizer(), DataConfig(prompt_template="Q: {question}"))
    with pytest.raises(MilesUserError, match=r"takes \{prompt\} only"):
        formatter.text("2+2?")
    assert PromptFormatter(WordTokenizer(), DataConfig(prompt_template="{prompt} {{x}}")).text("a") == "a {x}"


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def test_a_label_key_no_row_has_is_a_user_error(tmp_path: Path) -> None:
    """A typo in data.label_key stops at start with the keys the rows have, instead of training on None."""
    flat = _jsonl(tmp_path / "flat.jsonl", [{"prompt": "q0", "gold": "0"}, {"prompt": "q1", "gold": "1"}])
    with pytest.raises(
        MilesUserError, match=r"data.label_key='glod'.*\['gold', 'prompt'\].*Set data.label_key"
    ):
        load_rows(DataConfig(path=flat, label_key="glod"))
    # A dotted key into verl's nested schema: the nested keys are listed under their dotted names.
    verl = _jsonl(
        tmp_path / "verl.jsonl", [{"prompt": "q", "reward_model": {"ground_truth": "4", "style": "rule"}}]
    )
    with pytest.raises(MilesUserError, match=r"'reward_model.ground_truth', 'reward_model.style'"):
        load_rows(DataConfig(path=verl, label_key="reward_model.ground_truht"))
    # The held-out file is checked too, naming its path.
    with pytest.raises(MilesUserError, match="data.eval_path"):
        load_rows(DataConfig(train_size=4, test_size=2, eval_path=flat, label_key="answer"))


def test_label_keys_that_rows_do_have_keep_working(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Present but null in a row, or absent from some rows: those rows have no label (as before).
    some = _jsonl(
        tmp_path / "some.jsonl",
        [{"prompt": "a", "gold": None}, {"prompt": "b", "gold": "2"}, {"prompt": "c"}],
    )
    assert [r.label for r in load_rows(DataConfig(path=some, label_key="gold"))[0]] == [None, "2", None]
    verl = _jsonl(tmp_path / "verl.jsonl", [{"prompt": "q", "reward_model": {"ground_truth": "4"}}])
    assert [r.label for r in load_rows(DataConfig(path=verl, label_key="reward_model.ground_truth"))[0]] == [
        "4"
    ]
    assert [r.label for r in load_rows(DataConfig(path=verl))[0]] == ["4"]  # the default key's fallback
    # The default key on prompts without labels (rewards that need none: format, length, a judge): a
    # warning naming the key to set, not an error.
    bare = _jsonl(tmp_path / "bare.jsonl", [{"prompt": "a", "target": "1"}])
    with caplog.at_level("WARNING", logger="miles.data"):
        assert [r.label for r in load_rows(DataConfig(path=bare))[0]] == [None]
    assert "no row of" in caplog.text and "data.label_key" in caplog.text and "'target'" in caplog.text


BAD_JSONL: dict[str, tuple[bytes, str]] = {
    # name: (file content, what the error must say: the file's name, the line, the problem, what to do)
    "empty": (b"", r"empty\.jsonl has no rows.*one JSON object per line"),
    "blank_lines": (b"\n  \n", r"blank_lines\.jsonl has no rows"),
    "malformed_middle": (
        b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",\n{"prompt": "d"}\n',
        r"malformed_middle\.jsonl:3 is not valid JSON.*fix or remove that line",
    ),
    "not_utf8": (
        b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
        r"not_utf8\.jsonl:2 is not UTF-8.*save the file as UTF-8",
    ),
    "null_prompt": (
        b'{"prompt": "a"}\n\n{"prompt": null}\n',
        r"null_prompt\.jsonl:3.*'prompt' is null.*text or",
    ),
    "numeric_prompt": (b'{"prompt": 7}\n', r"numeric_prompt\.jsonl:1.*'prompt' is a number \(int\).*text or"),
    "empty_prompt": (b'{"prompt": "  "}\n', r"empty_prompt\.jsonl:1.*'prompt' is empty"),
    "bad_message": (
        b'{"prompt": [{"role": "user"}]}\n',
        r"bad_message\.jsonl:1.*'prompt'\[0\].*'content'.*\{\"role\": \"user\", \"content\": \"\.\.\.\"\}",
    ),
    "not_an_object": (b'{"prompt": "a"}\n[1, 2]\n', r"not_an_object\.jsonl:2 is a JSON array, not an object"),
    "missing_prompt_key": (
        b'{"prompt": "a"}\n{"question": "b"}\n',
        r"missing_prompt_key\.jsonl:2 has no 'prompt'.*data.prompt_key",
    ),
}


@pytest.mark.parametrize("name", list(BAD_JSONL))
def test_bad_jsonl_rows_name_the_file_line_and_key(tmp_path: Path, name: str) -> None:
    """Each way a data file can be broken stops at start with FILE:LINE and what to do, never a library's
    traceback (a bare StopIteration for an empty file, a pyarrow error for a malformed line)."""
    content, message = BAD_JSONL[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(content)
    with pytest.raises(MilesUserError, match=message):
        load_rows(DataConfig(path=str(path)))
    with pytest.raises(MilesUserError, match=message):  # the held-out file is read the same way
        load_rows(DataConfig(train_size=4, test_size=2, eval_path=str(path)))


def test_bad_parquet_and_dataset_folders_name_the_path(tmp_path: Path) -> None:
    import pandas as pd

    truncated = tmp_path / "cut.parquet"
    pd.DataFrame([{"prompt": f"q{i}", "label": str(i)} for i in range(50)]).to_parquet(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(MilesUserError, match=r"cut\.parquet cannot be read as parquet.*write it again"):
        load_rows(DataConfig(path=str(truncated)))
    nulls = tmp_path / "nulls.parquet"
    pd.DataFrame([{"prompt": "q0", "label": "0"}, {"prompt": None, "label": "1"}]).to_parquet(nulls)
    with pytest.raises(MilesUserError, match=r"nulls\.parquet row 2.*'prompt' is null"):
        load_rows(DataConfig(path=str(nulls)))
    not_a_dataset = tmp_path / "folder"
    not_a_dataset.mkdir()
    (not_a_dataset / "notes.txt").write_text("hi")
    with pytest.raises(MilesUserError, match=r"folder is not a saved dataset.*save_to_disk"):
        load_rows(DataConfig(path=str(not_a_dataset)))


def test_a_json_array_file_and_mixed_columns_still_load(tmp_path: Path) -> None:
    """What the json reader accepted before keeps working: a .json array of rows, rows with different keys."""
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"prompt": "a", "label": "1"}, {"prompt": "b", "label": 2, "extra": True}]))
    train, _ = load_rows(DataConfig(path=str(array)))
    assert [(r.prompt, r.label) for r in train] == [("a", "1"), ("b", 2)]
    lines = tmp_path / "rows.json.jsonl"
    lines.write_text(
        '{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}\r\n\r\n{"prompt": "b"}\r\n'
    )
    train, _ = load_rows(DataConfig(path=str(lines)))
    assert [r.prompt for r in train] == [[{"role": "user", "content": "hi"}], "b"]


class ChatTokenizer(WordTokenizer):
    chat_template = "{{ messages }}"


def test_fewshot_examples_are_chat_turns_after_the_system_message() -> None:
    shots = [{"user": "2 + 3 + 1 =", "assistant": "2 + 3 = 5\n5 + 1 = 6\n#### 6"}]
    formatter = PromptFormatter(ChatTokenizer(), DataConfig(system_prompt="Be brief.", fewshot=shots))
    assert formatter.messages("4 - 1 + 2 =") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 3 + 1 ="},
        {"role": "assistant", "content": "2 + 3 = 5\n5 + 1 = 6\n#### 6"},
        {"role": "user", "content": "4 - 1 + 2 ="},
    ]
    own_system = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "q"}]
    assert [m["content"] for m in formatter.messages(own_system)] == [
        "Mine.",
        shots[0]["user"],
        shots[0]["assistant"],
        "q",
    ]
    bare = PromptFormatter(ChatTokenizer(), DataConfig(fewshot=shots)).messages("q")
    assert [m["role"] for m in bare] == ["user", "assistant", "user"]
    with pytest.raises(MilesUserError, match="no chat template"):  # not dropped without a word
        PromptFormatter(WordTokenizer(), DataConfig(fewshot=shots))


def test_a_malformed_fewshot_example_is_a_user_error_at_start() -> None:
    from miles.config import MilesConfig
    from miles.config.validate import validate

    config = MilesConfig()
    config.data.fewshot = [{"question": "2 + 3 =", "answer": "5"}]
    with pytest.raises(MilesUserError, match=r"data.fewshot\[0\] has keys \['answer', 'question'\]"):
        validate(config)
    config.data.fewshot, config.data.prompt_template = [{"user": "2 + 3 =", "assistant": "5"}], "Q: {prompt}"
    with pytest.raises(MilesUserError, match="data.fewshot adds chat turns"):
        validate(config)
