"""The `miles` CLI: help, resolved config, and every user error exits non-zero with a message, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def miles(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_component_imports() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import miles.rollout, miles.trainer, miles.weight_sync, miles.rewards"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


def test_import_miles_is_light() -> None:
    code = "import sys, miles, miles.cli; print(any(m in sys.modules for m in ('torch', 'wandb', 'ray', 'flashinfer')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_help_lists_commands_recipes_and_groups() -> None:
    top = miles("--help")
    assert top.returncode == 0 and "train" in top.stdout and "init-model" in top.stdout
    train = miles("train", "--help")
    assert train.returncode == 0
    for name in (
        "grpo_math",
        "grpo_gpu",
        "gspo_moe",
        "sft_math",
        "grpo_smollm2_math",
        "grpo_smollm2_reasoning",
        "model",
        "algorithm",
        "placement",
    ):
        assert name in train.stdout


def test_cfg_job_prints_resolved_config(tmp_path: Path) -> None:
    out = miles("train", "recipe=grpo_math", "--cfg", "job", "trainer.lr=0.5", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "recipe: grpo_math" in out.stdout and "lr: 0.5" in out.stdout
    assert not (tmp_path / "outputs").exists()
    gspo = miles("train", "recipe=gspo_moe", "--cfg", "job", cwd=tmp_path)
    assert gspo.returncode == 0, gspo.stderr
    assert "policy_loss: gspo" in gspo.stdout and "loss_agg: seq_mean_token_mean" in gspo.stdout
    gpu = miles("train", "recipe=grpo_gpu", "--cfg", "job", cwd=tmp_path)  # composes without a GPU
    assert gpu.returncode == 0, gpu.stderr
    assert "dtype: bfloat16" in gpu.stdout and "master_weights: true" in gpu.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["trainer.lerning_rate=1"], "lerning_rate"),
        (["recipe=nope"], "grpo_math"),
        (["model=nope"], "tiny_moe_math"),
        (["trainer.max_steps=abc", "--cfg", "job"], "max_steps"),
        (["nosuchgroup.key=1"], "Valid keys"),
        (["+trainer.lerning_rate=1", "--cfg", "job"], "Valid keys under trainer"),  # `+` checks keys too
        (["trainer.backend=deepspeed", "trainer.zero_stage=4", "logging.wandb=false"], "not a ZeRO stage"),
        (["trainer.backend=deepspeed", "trainer.offload_param=cpu"], "needs trainer.zero_stage=3"),
        (["trainer.backend=megatron", "trainer.precision=bf16", "model.device=cpu"], "precision=fp32 on CPU"),
        (
            ["placement=ray", "placement.num_engines=3", "logging.wandb=false"],
            "must be 0 or placement.num_processes",
        ),
        # Read by the loop only after the first rollout: checked at start instead.
        (["algorithm.advantage=grpoo", "trainer.max_steps=1"], "unknown advantage estimator 'grpoo'"),
        (["algorithm.policy_loss=ppo", "trainer.max_steps=1"], "unknown policy loss 'ppo'"),
        (["trainer.routing_replay=true", "trainer.max_steps=1"], "rollout.record_routing=true"),
        (["rollout.rollout_batch_size=0", "trainer.max_steps=1"], "rollout_batch_size must be at least 1"),
        (["trainer.global_batch_size=0", "trainer.max_steps=1"], "global_batch_size must be at least 1"),
        (["model.dtype=float64", "trainer.max_steps=1"], "model.dtype=float64: use one of"),
        (["model.dtype=float16", "trainer.max_steps=1"], "use model.dtype=bfloat16"),
        (["algorithm.loss_agg=sum", "trainer.max_steps=1"], "algorithm.loss_agg=sum: use one of"),
        (["algorithm.group_filter=nonzero", "trainer.max_steps=1"], "algorithm.group_filter 'nonzero'"),
        (["algorithm.filter_max_batches=0", "trainer.max_steps=1"], "filter_max_batches must be at least 1"),
        (["algorithm.overlong_buffer=24", "trainer.max_steps=1"], "algorithm.overlong_buffer=24 must be 0"),
        (["rollout.n_samples_per_prompt=1", "trainer.max_steps=1"], "every advantage 0, nothing learned"),
        (["trainer.tensor_parallel_size=2"], "needs trainer.backend=megatron"),
        (
            ["trainer.backend=megatron", "trainer.tensor_parallel_size=2"],
            "placement.num_processes to a multiple of 2",
        ),
        (
            ["trainer.backend=megatron", "trainer.tensor_parallel_size=2", "placement.num_processes=3"],
            "must divide placement.num_processes=3",
        ),
    ],
)
def test_user_errors_are_clean(args: list[str], needle: str, tmp_path: Path) -> None:
    out = miles("train", *args, cwd=tmp_path)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert needle in text
    assert "Traceback" not in text


def test_dict_overrides_compose_as_the_readme_writes_them(tmp_path: Path) -> None:
    """A key inside a free-form dict field (reward.kwargs, reward.weights) is set without Hydra's `+`."""
    out = miles(
        "train",
        "reward.kwargs.target_len=128",
        "reward.weights={math: 1.0, format: 0.2}",
        "reward.by_data_source.gsm8k=math",
        "--cfg",
        "job",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    for line in ("target_len: 128", "format: 0.2", "gsm8k: math"):
        assert line in out.stdout, line


def test_valid_keys_listed_for_typo(tmp_path: Path) -> None:
    out = miles("train", "trainer.lerning_rate=1", cwd=tmp_path)
    assert "max_steps" in out.stderr and "lr" in out.stderr


def test_unknown_command() -> None:
    out = miles("frobnicate")
    assert out.returncode == 2 and "unknown command" in out.stderr and "Traceback" not in out.stderr


def test_missing_model_path_is_a_clean_error(tmp_path: Path) -> None:
    out = miles(
        "train",
        f"model.path={tmp_path / 'nothing'}",
        "logging.wandb=false",
        "logging.progress=false",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "config.json" in out.stderr and "Traceback" not in out.stderr


def test_wheel_ships_configs_recipes_and_assets(tmp_path: Path) -> None:
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    wheel = next(tmp_path.glob("miles-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "miles/recipes/grpo_math.yaml" in names
    assert "miles/configs/miles_base.yaml" in names
    assert "miles/configs/model/tiny_moe_math.yaml" in names
    assert "miles/rollout/__init__.py" in names and "miles/rewards/__init__.py" in names
    assert any(n.startswith("miles/assets/tiny_moe_math/") and n.endswith(".safetensors") for n in names)
    # An unpacked wheel, imported from elsewhere, still resolves the recipe.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {"PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", "--cfg", "job"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **env},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "builtin:tiny_moe_math" in out.stdout


def test_a_run_folder_holds_no_api_key(tmp_path: Path) -> None:
    """Secrets given on the command line (a remote reward's URL credentials, `?key=`, an Authorization
    header) reach neither the run folder's files (config.yaml masked, no Hydra .hydra/ copies) nor the
    console, even when the reward's error quotes its URL."""
    secrets = ("pw1234567", "KEY12345678", "TOKEN1234567890")
    out = miles(
        "train", "recipe=grpo_math", "trainer.max_steps=1", "trainer.eval_every=0", "logging.wandb=false",
        "logging.progress=false", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
        "trainer.global_batch_size=4", "reward.fn=remote",
        'reward.kwargs.url="http://alice:pw1234567@127.0.0.1:9/score?key=KEY12345678"',
        '+reward.kwargs.headers={Authorization:"Bearer TOKEN1234567890"}', "hydra.run.dir=run",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and not (run / ".hydra").exists()
    assert "***" in (run / "config.yaml").read_text()
    files = [p for p in run.rglob("*") if p.is_file()]
    for text in [out.stdout, out.stderr, *(p.read_bytes().decode("utf-8", "replace") for p in files)]:
        assert not any(secret in text for secret in secrets)
