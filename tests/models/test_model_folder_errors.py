"""Broken model folders are refused at load with a message naming the file and what to do: no usable tokenizer
(transformers would quietly build an empty one from config.json), truncated or missing safetensors shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles.errors import MilesUserError
from miles.model_io import builtin_dir, load_model
from miles.models.tokenizer import char_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _copy_shipped(dest: Path, skip: tuple[str, ...] = ()) -> Path:
    shutil.copytree(
        builtin_dir("tiny_moe_math"), dest, ignore=lambda _d, names: [n for n in names if n in skip]
    )
    return dest


def test_a_folder_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    folder = _copy_shipped(tmp_path / "no_tokenizer", skip=TOKENIZER_FILES)
    with pytest.raises(MilesUserError, match=r"no_tokenizer.*tokenizer.*copy the model's tokenizer"):
        load_model(str(folder), device="cpu")


def test_a_tokenizer_that_loads_empty_is_refused(tmp_path: Path) -> None:
    """A tokenizer_config.json alone (no vocabulary) loads as a tokenizer of 0-1 tokens that encodes every text
    to nothing: refused, not trained on."""
    folder = _copy_shipped(tmp_path / "empty_tokenizer", skip=TOKENIZER_FILES)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    with pytest.raises(
        MilesUserError, match=r"empty_tokenizer.*(vocabulary|tokens).*copy the model's tokenizer"
    ):
        load_model(str(folder), device="cpu")


def test_a_tokenizer_larger_than_the_model_s_vocabulary_is_refused(tmp_path: Path) -> None:
    """Ids past the embedding's rows would fail mid-run (an index error, or a device assert on a GPU)."""
    folder = _copy_shipped(tmp_path / "other_tokenizer", skip=TOKENIZER_FILES)
    tokenizer = char_tokenizer()
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(10)])
    tokenizer.save_pretrained(str(folder))
    with pytest.raises(MilesUserError, match=r"other_tokenizer.*111 tokens.*101 rows"):
        load_model(str(folder), device="cpu")


def test_a_truncated_safetensors_file_is_named(tmp_path: Path) -> None:
    folder = _copy_shipped(tmp_path / "truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(MilesUserError, match=r"truncated/model\.safetensors.*(truncated|incomplete).*copy"):
        load_model(str(folder), device="cpu")


def test_a_shard_the_index_names_but_the_folder_lacks_is_named(tmp_path: Path) -> None:
    folder = _copy_shipped(tmp_path / "sharded")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(MilesUserError, match=r"model-00002-of-00002\.safetensors.*missing"):
        load_model(str(folder), device="cpu")
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(MilesUserError, match=r"model\.safetensors\.index\.json.*not valid JSON"):
        load_model(str(folder), device="cpu")
