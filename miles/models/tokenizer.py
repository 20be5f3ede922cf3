"""The character-level tokenizer of the tiny models, and offline tokenizer loading.

One token per character keeps every digit its own token (arithmetic stays local) and needs no training.
It is built with the `tokenizers` library and saved as a standard fast tokenizer (tokenizer.json +
tokenizer_config.json + chat_template.jinja), so `transformers.AutoTokenizer.from_pretrained(dir)` loads
it with no custom code and no network.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.errors import MilesUserError

PAD, UNK, END_OF_TEXT, IM_START, IM_END = "<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, END_OF_TEXT, IM_START, IM_END)
# Newline plus all printable ASCII (space .. ~): digits, letters, punctuation, `#+-*/=()$\{}` and the rest.
CHARACTERS: tuple[str, ...] = ("\n", *(chr(code) for code in range(32, 127)))
# Qwen's chat format without the tool and thinking branches; no BOS is ever prepended (as in Qwen).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODEL_MAX_LENGTH = 1024
# Files whose presence marks a folder as holding a tokenizer transformers can load.
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_COPY_HINT = (
    "copy the model's tokenizer files (tokenizer.json, tokenizer_config.json and the rest) into {path} from "
    "where the weights came from, or point model.path at the original folder"
)


def char_vocab() -> dict[str, int]:
    return {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def char_vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(CHARACTERS)


def char_tokenizer() -> Any:
    """The character tokenizer as a `transformers.PreTrainedTokenizerFast` (in memory).

    eos is `<|im_end|>` (what the chat template ends a turn with), pad is a separate `<pad>` (so a pad
    position is never mistaken for an end of turn), characters outside the vocabulary become `<unk>`.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(char_vocab(), unk_token=UNK))
    # Every character is its own pre-token; `[\s\S]` also matches newline, which `.` would not.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join characters back without separators
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=IM_END,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def save_char_tokenizer(directory: str | Path) -> Path:
    """Write the character tokenizer's files into `directory` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    char_tokenizer().save_pretrained(str(directory))
    tidy_tokenizer_config(directory)
    return directory


def tidy_tokenizer_config(directory: str | Path) -> None:
    """Make a saved tokenizer_config.json portable: transformers 5 names its own backend class (which 4.x
    lacks) and records how the tokenizer was loaded; the generic fast class loads on both."""
    config_file = Path(directory) / "tokenizer_config.json"
    if not config_file.exists():
        return
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend" and (Path(directory) / "tokenizer.json").exists():
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / name).exists() for name in _TOKENIZER_MARKERS)


def load_tokenizer(path: str | Path) -> Any:
    """`AutoTokenizer` from a local folder only (never the hub); a clear error when it holds no tokenizer."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise MilesUserError(f"tokenizer folder {path} does not exist")
    if not has_tokenizer_files(path):
        raise MilesUserError(
            f"{path} holds no tokenizer files (looked for {', '.join(_TOKENIZER_MARKERS)}); copy the model's "
            "tokenizer there, or use `miles init-model --preset tiny` which writes its own"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # OSError, a JSON error, the Rust backend's own: a damaged file, whichever
        raise MilesUserError(
            f"could not load the tokenizer in {path} ({type(e).__name__}: {e}); "
            + _COPY_HINT.format(path=path)
        ) from e


PROBE_TEXT = "Hello, world! 12 + 7 = 19"
"""Text any usable tokenizer turns into tokens other than unk (letters, digits, punctuation, spaces)."""


def check_tokenizer(tokenizer: Any, path: str | Path, vocab_size: int | None = None) -> None:
    """Refuses a tokenizer that cannot drive the model: transformers builds an empty one from a config.json
    alone (0-1 tokens; every text encodes to nothing), and a run on it skips every step and exits 0. With
    `vocab_size` (the model's embedding rows), also one whose ids would run past the embedding."""
    size = len(tokenizer)
    ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    unk = getattr(tokenizer, "unk_token_id", None)
    if size < 2 or not ids or all(i == unk for i in ids):
        raise MilesUserError(
            f"the tokenizer in {path} is unusable: its vocabulary has {size} tokens and it encodes "
            f"{PROBE_TEXT!r} to {ids[:8]} (no tokenizer vocabulary there, only a config?); "
            + _COPY_HINT.format(path=path)
        )
    if vocab_size is not None and size > vocab_size:
        raise MilesUserError(
            f"the tokenizer in {path} has {size} tokens but the model's embedding has {vocab_size} rows "
            "(config.json vocab_size): it is another model's tokenizer; " + _COPY_HINT.format(path=path)
        )


_SPECIAL_TOKENS: weakref.WeakKeyDictionary[Any, Mapping[int, str]] = weakref.WeakKeyDictionary()
"""Per tokenizer, its `special_tokens` (a Llama 3 tokenizer's 256 reserved tokens take ~0.3 ms to list)."""


def special_tokens(tokenizer: Any) -> Mapping[int, str]:
    """Id -> text of the tokens `decode(skip_special_tokens=True)` leaves out: a tokenizers backend leaves out
    every added token marked special, also those missing from `all_special_ids` (the tiny models'
    `<|endoftext|>` and `<|im_start|>`); a Python tokenizer leaves out `all_special_ids`."""
    try:
        return _SPECIAL_TOKENS[tokenizer]
    except (KeyError, TypeError):  # TypeError: a tokenizer that cannot be weakly referenced is not cached
        pass
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {int(i): str(t.content) for i, t in added.items() if getattr(t, "special", False)}
    for i in getattr(tokenizer, "all_special_ids", None) or ():
        found.setdefault(int(i), str(tokenizer.convert_ids_to_tokens(int(i))))
    try:
        _SPECIAL_TOKENS[tokenizer] = found
    except TypeError:
        pass
    return found
