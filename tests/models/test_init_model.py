"""`miles init-model` and the presets: tiny checkpoints both we and transformers load, real shapes, user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from miles.errors import MilesUserError
from miles.models import CausalLM, from_pretrained
from miles.models.init_model import main
from miles.models.presets import PRESETS, REAL, checkpoint_bytes, preset_args
from miles.models.tokenizer import char_vocab_size, save_char_tokenizer

ARCH_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}


@pytest.mark.parametrize("arch", list(ARCH_CLASSES))
@torch.no_grad()
def test_tiny_checkpoint_loads_in_ours_and_transformers(arch: str, tmp_path: Path) -> None:
    out = tmp_path / arch
    assert main(["--arch", arch, "--preset", "tiny", "--out", str(out), "--seed", "3"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= names
    ours = from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf).__name__ == ARCH_CLASSES[arch]
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert ours.args.vocab_size == len(tok) == char_vocab_size()
    assert ours.args.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert ours.args.pad_token_id == tok.pad_token_id
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    messages = [{"role": "user", "content": "What is 12+30?"}]
    ids = torch.tensor(
        [tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]]
    )
    expected = hf(ids).logits
    assert float((ours(ids) - expected).abs().max() / expected.abs().max()) <= 1e-5


def test_seed_and_dtype(tmp_path: Path) -> None:
    def weights(folder: Path) -> dict[str, torch.Tensor]:
        return from_pretrained(folder, dtype=None).state_dict()

    for name, seed, dtype in [
        ("a", 1, "float32"),
        ("b", 1, "float32"),
        ("c", 2, "float32"),
        ("d", 1, "bfloat16"),
    ]:
        argv = ["--arch", "qwen3", "--preset", "tiny", "--out", str(tmp_path / name), "--seed", str(seed)]
        assert main([*argv, "--dtype", dtype]) == 0
    a, b, c = weights(tmp_path / "a"), weights(tmp_path / "b"), weights(tmp_path / "c")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "d" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert from_pretrained(tmp_path / "d", dtype="bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16


def test_force_replaces_and_tokenizer_option(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert main(["--arch", "llama", "--preset", "tiny", "--out", str(out)]) == 0
    tokenizer_dir = save_char_tokenizer(tmp_path / "tok")
    argv = ["--arch", "qwen3_moe", "--preset", "tiny", "--out", str(out), "--tokenizer", str(tokenizer_dir)]
    assert main([*argv, "--force"]) == 0
    assert from_pretrained(out).args.model_type == "qwen3_moe"
    assert (out / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--arch", "gpt2", "--preset", "tiny"],
            "unknown arch 'gpt2'; choose one of: qwen3, qwen3_moe, llama",
        ),
        (["--arch", "qwen3", "--preset", "huge"], "unknown preset 'huge'; choose one of: tiny, qwen3-0.6b"),
        (["--preset", "tiny"], "preset tiny needs an arch"),
        (["--arch", "qwen3", "--preset", "qwen3-30b-a3b"], "is a qwen3_moe model, not qwen3"),
        (["--preset", "qwen3-8b"], "pass --allow-large"),
        (["--preset", "qwen3-0.6b"], "pass --allow-large"),  # 2.4 GB in float32
        (["--arch", "qwen3", "--preset", "tiny", "--dtype", "float8"], "choose float32 or bfloat16"),
        (["--arch", "qwen3", "--preset", "tiny", "--tokenizer", "/nonexistent/tok"], "does not exist"),
        (["--arch", "qwen3"], "the following arguments are required: --preset"),
    ],
)
def test_user_errors_exit_2_with_message(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_existing_out_needs_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--arch", "qwen3", "--preset", "tiny", "--out", str(tmp_path)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err


def test_cli_error_has_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles",
            "init-model",
            "--arch",
            "qwen3",
            "--preset",
            "nope",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "unknown preset 'nope'" in result.stderr and "Traceback" not in result.stderr


def test_tiny_presets_are_a_few_hundred_thousand_parameters() -> None:
    for arch in ARCH_CLASSES:
        args = preset_args(arch, "tiny")
        assert args.vocab_size == char_vocab_size()
        assert 100_000 <= checkpoint_bytes(args, "float32") // 4 <= 1_000_000, arch
    assert preset_args("qwen3", "tiny", vocab_size=300).vocab_size == 300
    with pytest.raises(MilesUserError):
        preset_args("qwen3", "tiny", vocab_size=0)


# Published sizes (model cards): total and non-embedding parameters.
PUBLISHED = {
    "qwen3-0.6b": (0.6e9, 0.44e9),
    "qwen3-1.7b": (1.7e9, 1.4e9),
    "qwen3-4b": (4.0e9, 3.6e9),
    "qwen3-8b": (8.2e9, 6.95e9),
    "qwen3-30b-a3b": (30.5e9, 29.9e9),
}


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "tiny"])
def test_real_presets_match_transformers_and_model_cards(preset: str) -> None:
    args = preset_args(None, preset)
    assert preset_args(args.model_type, preset) == args
    hf_config = AutoConfig.for_model(**args.to_hf_dict())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
        ours = CausalLM(args)
    assert type(hf).__name__ == ARCH_CLASSES[args.model_type]
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items() if "rotary" not in k}
    ours_count = sum(p.numel() for p in ours.parameters())
    assert ours_count == sum(p.numel() for p in hf.parameters())
    assert ours_count * 4 == checkpoint_bytes(args, "float32")
    assert hf_shapes["model.embed_tokens.weight"] == (args.vocab_size, args.hidden_size)
    if preset in PUBLISHED:
        total, non_embedding = PUBLISHED[preset]
        embedding = args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
        assert abs(ours_count - total) / total < 0.02
        assert abs(ours_count - embedding - non_embedding) / non_embedding < 0.01
        assert (args.vocab_size, args.head_dim, args.rope_theta, args.max_position_embeddings) == (
            151936,
            128,
            1_000_000.0,
            40960,
        )
        assert args.tie_word_embeddings == (preset in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"))
        assert args.eos_token_id == 151645
    assert set(REAL) == set(PRESETS) - {"tiny"}
