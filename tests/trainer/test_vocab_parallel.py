"""Review of the megatron backend: numerics of the vocabulary-parallel softmax, token ids outside the
vocabulary (its padding rows included), and model configs megatron-core cannot represent.

Two processes over gloo split the LM head (TP=2, a vocabulary of 33 padded to 34); the reference is a float64
softmax of the same logits. Inputs are multiples of 1/8 so every logit is exact in float32 whatever the GEMM's
summation order: what is left to compare is the softmax's own arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from miles.errors import MilesUserError
from tests.support.trainer import tiny_model

pytest.importorskip("megatron.core")

VOCAB = 33
OFFSET = 200.0
"""Added to every logit: large logits are where `log Z - E[z]` in unshifted float32 loses its digits."""


def _exact_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [7, 8], weight [VOCAB, 8], targets [7]) whose logits are exact float32 numbers around OFFSET."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randint(-16, 17, (7, 8), generator=gen).float() / 8
    weight = torch.randint(-24, 25, (VOCAB, 8), generator=gen).float() / 8
    hidden[:, 0] = 1.0
    weight[:, 0] = OFFSET
    return hidden, weight, torch.randint(0, VOCAB, (7,), generator=gen)


def _review_worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    from miles.models import VarlenAttention
    from miles.trainer.logprobs import chunked_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        hidden, weight, targets = _exact_inputs()
        padded = torch.cat([weight, weight.new_zeros(-VOCAB % 2, weight.shape[1])])
        part = padded.chunk(2)[rank].clone().requires_grad_(True)
        h = hidden.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(
            h, part, targets, 1.0, True, True, rows_per_chunk=3, group=dist.group.WORLD, vocab_size=VOCAB
        )
        (lp.sum() + 0.5 * ent.sum()).backward()
        out = {"lp": lp.detach(), "ent": ent.detach(), "h": h.grad, "w": part.grad}

        # token ids outside the vocabulary: in its padding row (33), past the padded one (40), negative
        refused = []
        for bad in (VOCAB, 40, -1):
            wrong = targets.clone()
            wrong[2] = bad
            try:
                chunked_logprobs(hidden, part, wrong, 1.0, True, group=dist.group.WORLD, vocab_size=VOCAB)
            except ValueError as err:
                refused.append("vocabulary" in str(err))
            else:
                refused.append(False)
        from miles.trainer.backends import build_policy
        from tests.support.tp import tiny_dense

        # engine -> megatron (split, padded) -> engine (gathered, cut back): bit for bit, tied or not
        round_trip = []
        for tied in (False, True):
            model = tiny_dense(tied=tied, vocab=VOCAB)
            policy = build_policy("megatron", model, tensor_parallel=2)
            back, own = dict(policy.engine_weights()), dict(model.named_parameters())
            round_trip.append(back.keys() == own.keys() and all(torch.equal(back[k], own[k]) for k in back))
        out["round_trip"] = torch.tensor(round_trip)
        for bad in (VOCAB, 40):
            ids = torch.tensor([1, 2, bad, 4])
            try:
                policy.forward_packed(ids, torch.arange(4), VarlenAttention([0, 4]))
            except ValueError as err:
                refused.append("vocabulary" in str(err))
            else:
                refused.append(False)
        out["refused"] = torch.tensor(refused)
        save_file(out, str(Path(out_dir) / f"review{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("vocab_review")
    mp.start_processes(_review_worker, args=(str(out / "store"), str(out)), nprocs=2, start_method="spawn")
    return [load_file(str(out / f"review{r}.safetensors")) for r in range(2)]


def test_vocabulary_parallel_softmax_of_large_logits_equals_float64(tp2_results) -> None:
    # Before the fix, log Z = max + log(sum) and H = log Z - sum p z were formed in unshifted float32: at
    # logits of ~200 that lost 7e-6 of the logprobs, 2.5e-5 of the entropy and 3e-5 to 5e-5 of the gradients
    # (3.6e-3 of the offset column's), where the whole-vocabulary path, a float32 log_softmax, is within
    # 1e-6 (4e-5 in the offset column, whose gradient is 200 times a sum that cancels to ~0).
    hidden, weight, targets = _exact_inputs()
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    log_q = (h @ w.T).log_softmax(-1)
    lp = log_q.gather(-1, targets[:, None])[:, 0]
    ent = -(log_q.exp() * log_q).sum(-1)
    (lp.sum() + 0.5 * ent.sum()).backward()
    for got in tp2_results:
        assert (got["lp"].double() - lp.detach()).abs().max() <= 1e-6
        assert (got["ent"].double() - ent.detach()).abs().max() <= 1e-6
        torch.testing.assert_close(got["h"][:, 1:].double(), h.grad[:, 1:], rtol=0, atol=3e-6)
        torch.testing.assert_close(got["h"][:, 0].double(), h.grad[:, 0], rtol=0, atol=2e-4)
    grad_w = torch.cat([tp2_results[0]["w"], tp2_results[1]["w"]]).double()
    torch.testing.assert_close(grad_w[:VOCAB], w.grad, rtol=0, atol=3e-6)
    assert grad_w[VOCAB:].abs().sum() == 0  # the padding row never gets probability mass


def test_token_ids_outside_the_vocabulary_are_refused_under_tensor_parallelism(tp2_results) -> None:
    # One process's lookup raises an index error; split over TP=2 a target in the padding row got a logprob
    # of -1e30, one past it (or negative) the plausible -log Z, and an input id an embedding of zeros.
    for got in tp2_results:
        assert got["refused"].tolist() == [True] * 5


def test_tensor_parallel_weights_round_trip_bit_for_bit(tp2_results) -> None:
    for got in tp2_results:
        assert got["round_trip"].tolist() == [True, True]


def test_top1_renormalised_moe_router_is_refused_with_what_to_do() -> None:
    # megatron-core's TransformerConfig raises "Please use --moe-router-pre-softmax when topk is 1." (a
    # megatron CLI flag, a ValueError) for Qwen3-MoE's top-1 router with norm_topk_prob
    from miles.trainer.megatron.policy import MegatronPolicy

    model = tiny_model(num_experts=4, num_experts_per_tok=1, norm_topk_prob=True)
    with pytest.raises(MilesUserError, match="num_experts_per_tok=1.*trainer.backend=torch"):
        MegatronPolicy.from_model(model)
    # unnormalised top-1 is megatron's pre-softmax router: built, and it computes our model's hidden states
    from miles.models import VarlenAttention

    model = tiny_model(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False)
    policy = MegatronPolicy.from_model(model)
    ids = torch.randint(0, model.args.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.forward_packed(ids, torch.arange(20), VarlenAttention([0, 20])).hidden
        theirs = policy.forward_packed(ids, torch.arange(20), VarlenAttention([0, 20])).hidden
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
