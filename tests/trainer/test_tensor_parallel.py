"""Megatron tensor parallelism on CPU (gloo): the TP-split trainer computes what one process computes.

Two processes split one replica (TP=2), or four make two replicas of two (TP=2 x DP=2); each passes the loop's
share of the samples. Compared with the `torch` backend in one process on the whole batch: the vocabulary-
parallel logprobs and entropy, the update's metrics and the gathered weights after it, and a checkpoint
(whole-tensor optimizer state) that resumes bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from miles.distributed import SINGLE
from miles.errors import MilesUserError
from miles.tracking import read_records
from miles.trainer.backends import build_policy
from miles.trainer.logprobs import packed_logprobs
from miles.trainer.megatron.layout import to_megatron, tp_partition, tp_shard, tp_unshard
from miles.trainer.packing import pack
from tests.support.cli import run_miles
from tests.support.dp import make_trainer, scored_samples
from tests.support.tp import tiny_dense, tp_worker
from tests.trainer.test_megatron import COMMON

pytest.importorskip("megatron.core")

CASES = {
    "tp2_untied_two_steps": {"world": 2, "tied": False, "steps": 2, "global_batch_size": 4},
    "tp2_tied": {"world": 2, "tied": True, "steps": 1, "global_batch_size": 6},
    "tp2_dp2": {"world": 4, "tied": False, "steps": 1, "global_batch_size": 6},
    "tp2_odd_vocabulary": {"world": 2, "tied": True, "steps": 1, "global_batch_size": 6, "vocab": 33},
}


def test_shards_of_every_weight_put_back_together() -> None:
    model = tiny_dense(tied=False)
    for name, whole in to_megatron(model.named_parameters(), model.args):
        shards = [tp_shard(name, whole, r, 2) for r in range(2)]
        assert torch.equal(tp_unshard(name, shards), whole), name
        if tp_partition(name) is not None:
            assert shards[0].numel() * 2 == whole.numel() and not torch.equal(shards[0], shards[1]), name
    gate_up = "decoder.layers.0.mlp.linear_fc1.weight"  # each rank holds [its gate rows; its up rows]
    whole = torch.arange(8.0)[:, None]
    assert tp_shard(gate_up, whole, 1, 2).flatten().tolist() == [2.0, 3.0, 6.0, 7.0]


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_update_equals_one_process(name: str, tmp_path: Path) -> None:
    # AdamW's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps, the last-bit
    # differences of TP's other reduction order move it by up to lr * |dg| / eps (1e-4 of the 1e-2 lr was seen
    # on one CPU model with eps 1e-8). A larger eps keeps the comparison well-conditioned at the same atol.
    case = {"vocab": 32, "eps": 1e-6, **CASES[name], "num_samples": 6, "loss_agg": "token_mean"}
    world = case["world"]
    mp.start_processes(
        tp_worker,
        args=(world, 2, str(tmp_path / "store"), case, str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    model = tiny_dense(case["tied"], case["vocab"])
    samples = scored_samples(case["num_samples"])
    batch = pack(samples, list(range(len(samples))), 10_000, torch.device("cpu"))[0]
    with torch.no_grad():
        want = packed_logprobs(model, batch, with_entropy=True)
    trainer = make_trainer(model, case, SINGLE)
    expected = [trainer.train_step(samples) for _ in range(case["steps"] + 1)]

    got = load_file(str(tmp_path / "rank0.safetensors"))
    torch.testing.assert_close(got["logprobs"], want.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["entropy"], want.entropy, atol=1e-5, rtol=1e-5)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in reports[1:]:  # every rank reports the batch's (timings aside)
        for mine, theirs in zip(r["metrics"], reports[0]["metrics"]):
            assert _untimed(mine) == _untimed(theirs)
    for step, (mine, theirs) in enumerate(zip(reports[0]["metrics"] + [reports[0]["after"][0]], expected)):
        for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/tokens"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), (step, key)
    # the resumed trainer (whole weights in, whole optimizer state loaded and split again) took the same step
    assert _untimed(reports[0]["after"][1]) == _untimed(reports[0]["after"][0])
    moved = 0.0
    for key, value in model.state_dict().items():
        if f"w.{key}" not in got:
            assert case["tied"] and key == "lm_head.weight"
            continue
        torch.testing.assert_close(got[f"w.{key}"], value, rtol=0, atol=1e-4)
        assert torch.equal(got[f"resumed.{key}"], got[f"w.{key}"]), key
        moved = max(
            moved, (value - tiny_dense(case["tied"], case["vocab"]).state_dict()[key]).abs().max().item()
        )
    assert moved > 1e-3
    # checkpoints hold whole tensors, whatever the TP size
    shapes = reports[0]["state_shapes"]
    head = "output_layer" if not case["tied"] else "embedding.word_embeddings"
    assert shapes[f"optimizer.gpt.{head}.weight.exp_avg"] == [case["vocab"], 32]  # no padding rows


def test_tensor_parallel_bf16_master_weights_resume_bit_for_bit(tmp_path: Path) -> None:
    """bf16 weights split over TP=2 with float32 masters (each rank's part): the checkpoint holds the whole
    masters, a resumed trainer takes the same step bit for bit, and the update follows one process's."""
    # an odd vocabulary: the padded rows of the masters are cut off when saved and added back when loaded
    case = {"vocab": 33, "world": 2, "tied": False, "steps": 1, "global_batch_size": 6, "dtype": "bfloat16"}
    case.update(num_samples=6, loss_agg="token_mean")
    mp.start_processes(
        tp_worker, args=(2, 2, str(tmp_path / "store"), case, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    model = tiny_dense(case["tied"], case["vocab"]).to(torch.bfloat16)
    trainer = make_trainer(model, case, SINGLE)
    expected = [trainer.train_step(scored_samples(case["num_samples"])) for _ in range(2)]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    mine = reports[0]["metrics"] + [reports[0]["after"][0]]
    for step, (got, want) in enumerate(zip(mine, expected)):  # bf16 forwards: their rounding differs
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert got[key] == pytest.approx(want[key], rel=3e-2, abs=1e-6), (step, key)
    assert _untimed(reports[0]["after"][1]) == _untimed(reports[0]["after"][0])
    got = load_file(str(tmp_path / "rank0.safetensors"))
    for key in model.state_dict():
        assert torch.equal(got[f"resumed.{key}"], got[f"w.{key}"]), key
    shapes = reports[0]["state_shapes"]
    assert shapes["master.gpt.output_layer.weight"] == [case["vocab"], 32]  # whole, float32 in the file
    assert shapes["master.gpt.decoder.layers.0.mlp.linear_fc1.weight"] == [128, 32]


def _vocab_worker(rank: int, store: str, vocab: int, out_dir: str) -> None:
    import torch.distributed as dist

    from miles.trainer.logprobs import chunked_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(7, 8, generator=gen, dtype=torch.float64)
        weight = torch.randn(vocab, 8, generator=gen, dtype=torch.float64)
        targets = torch.randint(0, vocab, (7,), generator=gen)
        padded = torch.cat([weight, weight.new_zeros(-vocab % 2, 8)])
        part = padded.chunk(2)[rank].clone().requires_grad_(True)
        h = hidden.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(
            h, part, targets, 0.7, True, True, rows_per_chunk=3, group=dist.group.WORLD, vocab_size=vocab
        )
        (lp.sum() + 0.5 * ent.sum()).backward()
        save_file(
            {"lp": lp.detach(), "ent": ent.detach(), "h": h.grad, "w": part.grad},
            str(Path(out_dir) / f"vocab{rank}.safetensors"),
        )
    finally:
        dist.destroy_process_group()


def test_vocabulary_parallel_logprobs_equal_the_whole_vocabulary(tmp_path: Path) -> None:
    # temperature, the entropy gradient and a padded vocabulary (33 over 2 ranks); float64 inputs, whose
    # logits both paths compute in float32
    from miles.trainer.logprobs import chunked_logprobs

    mp.start_processes(
        _vocab_worker, args=(str(tmp_path / "store"), 33, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(33, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 33, (7,), generator=gen)
    lp, ent = chunked_logprobs(hidden, weight, targets, 0.7, True, True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    ranks = [load_file(str(tmp_path / f"vocab{r}.safetensors")) for r in range(2)]
    for got in ranks:
        torch.testing.assert_close(got["lp"], lp.detach().float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["ent"], ent.detach().float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["h"], hidden.grad, rtol=1e-4, atol=1e-5)  # float32 logits
    grad_w = torch.cat([ranks[0]["w"], ranks[1]["w"]])
    torch.testing.assert_close(grad_w[:33], weight.grad, rtol=1e-4, atol=1e-5)
    assert grad_w[33:].abs().sum() == 0  # the padding row


def test_a_shard_of_padding_only_is_left_out_of_the_softmax() -> None:
    # a vocabulary of 5 over 4 ranks is padded to 8: rank 3's two columns are both padding
    from miles.trainer.vocab_parallel import _PADDED_LOGIT, _local_logits

    h, w = torch.ones(1, 3), torch.ones(2, 3)
    assert _local_logits(h, w, 1.0, start=6, vocab_size=5).eq(_PADDED_LOGIT).all()
    rank2 = _local_logits(h, w, 1.0, start=4, vocab_size=5)[0]
    assert rank2[0] == 3.0 and rank2[1] == _PADDED_LOGIT
    assert _local_logits(h, w, 1.0, start=2, vocab_size=5)[0].tolist() == [3.0, 3.0]


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in ("train/tokens_per_s", "train/mfu")}


def test_tensor_parallel_settings_are_checked_at_start() -> None:
    with pytest.raises(MilesUserError, match="needs trainer.backend=megatron"):
        build_policy("torch", tiny_dense(tied=False), tensor_parallel=2)


@pytest.mark.slow
def test_grpo_with_tensor_parallel_follows_data_parallel_and_resumes_at_any_tp_size(tmp_path: Path) -> None:
    # a dense model (the shipped one is MoE) whose 101-token vocabulary is padded to split over 2 ranks;
    # the entropy bonus gives the untrained model's update a gradient while its rewards are all 0
    from miles.models.init_model import main as init_model

    dense = tmp_path / "dense"
    assert init_model(["--arch", "qwen3", "--preset", "tiny", "--out", str(dense)]) == 0
    common = [
        *COMMON,
        f"model.path={dense}",
        "trainer.backend=megatron",
        "placement.num_processes=2",
        "algorithm.entropy_coef=0.01",
    ]
    runs = tmp_path / "runs"
    for name, extra in {
        "tp2": ["trainer.tensor_parallel_size=2"],
        "dp2": [],
        "tp2_resumed": [
            "trainer.tensor_parallel_size=2",
            f"trainer.resume_from={runs / 'tp2'}/checkpoints/step_000001",
        ],
        "dp2_from_tp2": [f"trainer.resume_from={runs / 'tp2'}/checkpoints/step_000001"],
    }.items():
        out = run_miles(tmp_path, *common, *extra, run_dir=runs / name)
        assert out.returncode == 0, out.stderr[-3000:]
    tp2, dp2 = read_records(runs / "tp2"), read_records(runs / "dp2")
    for mine, theirs in zip(tp2, dp2, strict=True):
        assert mine["sync/checksum_ok"] == mine["sync/replicas_equal"] == 1.0
        assert mine["mismatch/logprob_abs_diff_max"] < 1e-5  # the engine's model vs the TP-split megatron
        assert mine["train/grad_norm"] > 0
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
    resumed, switched = read_records(runs / "tp2_resumed")[-1], read_records(runs / "dp2_from_tp2")[-1]
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        assert resumed[key] == tp2[-1][key], key  # bit for bit
        assert switched[key] == pytest.approx(tp2[-1][key], rel=1e-5), key  # the checkpoint is TP-free
