"""Speculative decoding with a draft head (`rollout.speculative=head`, rollout/draft_head.py): the samples
are plain decoding's; each proposal starts from the model's hidden state at the row its last token was
sampled from, and is what the head computes from there; heads save and load through safetensors."""

from __future__ import annotations

import json

import pytest
import torch

from miles.models.attention import VarlenAttention
from miles.models.draft_head import (
    HEAD_CONFIG,
    DraftHead,
    DraftHeadArgs,
    load_draft_head,
    new_draft_head,
    save_draft_head,
)
from miles.rollout import Engine, EngineStats, SamplingParams
from miles.rollout.spec.decoder import SpecDecoder
from miles.rollout.spec.gate import SpecGate
from miles.rollout.spec.head import DraftHeadProposer
from miles.sample import SampleStatus
from tests.rollout.test_draft import PEAKY_PROMPTS
from tests.rollout.test_engine import PROMPTS, assert_same_samples, config, kv_bytes
from tests.support.models import assert_pool_clean, tiny_model


def _peaky_model():  # noqa: ANN202
    model = tiny_model(False, seed=5, max_position_embeddings=64)
    with torch.no_grad():  # peaky logits, so that stop ids are drawn and requests end early too
        model.lm_head.weight.mul_(4.0)
    return model


def _trained_head(model, samples) -> DraftHead:  # noqa: ANN001
    """A head trained on the model's own samples, so that many of its drafts are accepted."""
    from miles.config import RolloutConfig, TrainerConfig
    from miles.trainer.draft.head_trainer import DraftHeadTrainer

    head = new_draft_head(model.args, 0, model.dtype, model.device, seed=1)
    rollout = RolloutConfig(spec_draft_train=True, spec_draft_lr=3e-3, spec_draft_train_epochs=40)
    DraftHeadTrainer(head, model, TrainerConfig(), rollout).train_step(samples)
    return head.eval()


@pytest.mark.parametrize("setup", ["tiny_pool_chunks_pages", "moe_model_groups"])
def test_head_speculation_gives_the_same_samples(setup: str) -> None:
    """Tokens and statuses are plain decoding's, logprobs to float32 rounding: under preemption, chunked
    prefill and pages of 4; and for a MoE model with groups of n = 4 sharing their prompt."""
    if setup == "moe_model_groups":
        model = tiny_model(True, seed=5, max_position_embeddings=64)
        cfg: dict = {}
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=11, ignore_eos=True)
        prompts = PROMPTS
    else:
        model = _peaky_model()
        cfg = dict(
            kv_cache_bytes=kv_bytes(model, 140, page_size=4),
            page_size=4,
            max_batch_tokens=7,
            max_running_requests=6,
        )
        params = SamplingParams(
            n=3, temperature=0.9, top_p=0.95, max_new_tokens=30, seed=7, stop_token_ids=[41]
        )
        prompts = PEAKY_PROMPTS
    plain_cfg = {k: v for k, v in cfg.items() if k != "kv_cache_bytes"}
    plain = Engine(model, None, config(**plain_cfg)).generate(prompts, params)
    head = _trained_head(model, plain)
    engine = Engine(model, None, config(speculative="head", spec_draft_tokens=3, **cfg), draft_head=head)
    got = engine.generate(prompts, params)
    assert_pool_clean(engine)
    assert_same_samples(got, plain)
    m = engine.metrics()
    assert m["rollout/spec_steps"] > 0
    # (A random MoE model at temperature 1 spreads its draws: a head can agree with few of them.)
    share = 0.1 if setup == "moe_model_groups" else 0.3
    assert m["rollout/spec_accepted_tokens"] > share * m["rollout/spec_draft_tokens"]
    assert m["rollout/spec_proposed_tokens"] == m["rollout/spec_draft_tokens"]
    if setup != "moe_model_groups":
        assert {s.status for s in plain} == {SampleStatus.COMPLETED, SampleStatus.TRUNCATED}
        assert m["rollout/preemptions"] > 0, "the tiny pool was meant to force preemption"


def test_head_proposals_start_from_the_models_hidden_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every proposal's starting row equals the hidden state a full forward of the request's tokens gives at
    its next-to-last position, and its greedy drafts are the head's argmax chain from there."""
    model = tiny_model(False, seed=3, max_position_embeddings=64)
    engine = Engine(
        model,
        None,
        config(speculative="head", spec_draft_tokens=3, max_batch_tokens=9, max_running_requests=6),
    )
    head = engine.draft_head
    assert head is not None
    original = DraftHeadProposer.propose
    checked = []

    def checking(self, reqs, ks, hidden, rows):  # noqa: ANN001, ANN202
        drafts = original(self, reqs, ks, hidden, rows)
        for req, k, row, draft in zip(reqs, ks, rows, drafts):
            tokens = req.tokens(0, req.seq_len)
            ids = torch.tensor(tokens[:-1])
            full = model.forward_packed(ids, torch.arange(len(ids)), VarlenAttention([0, len(ids)])).hidden
            torch.testing.assert_close(hidden[row], full[-1], rtol=1e-5, atol=1e-5)
            state, token, want = full[-1:], torch.tensor(tokens[-1:]), []
            for _ in range(k):
                state = head(state, model.model.embed_tokens(token))
                token = model.lm_head(state).argmax(-1)
                want.append(int(token))
            assert draft == want
            checked.append(len(draft))
        return drafts

    monkeypatch.setattr(DraftHeadProposer, "propose", checking)
    monkeypatch.setattr(DraftHeadProposer, "chain", lambda *args: None)  # every proposal through `propose`
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    engine.generate(PROMPTS, params)
    assert len(checked) > 20 and max(checked) == 3


def compare_chained_proposals(monkeypatch: pytest.MonkeyPatch, whole_steps_only: bool = False) -> list[int]:
    """Check every proposal chained behind a verify step against `propose` from the row and token the host
    kept: the requests given chained drafts, per step, are appended to the returned list.
    `whole_steps_only`: compare only where every request of the chain goes on (a proposal graph then
    replays at the chain's own batch bucket, so its kernels are the chain's)."""
    original = SpecDecoder.head_proposals
    compared: list[int] = []

    def comparing(self: SpecDecoder, wanted: list, stats: EngineStats) -> None:
        chained = self.head_state.chained
        original(self, wanted, stats)
        if chained is None:
            return
        proposed = chained.read()
        used = [(r, k) for r, k in wanted if proposed.get(r.rid, (-1,))[0] == len(r.output_ids)]
        compared.append(len(used))
        if whole_steps_only and len(used) != len(proposed):
            return
        assert self.head_drafter is not None
        again = self.head_drafter.propose(
            [r for r, _ in used],
            [k for _, k in used],
            self.head_state.hidden,
            [self.head_state.rows[r.rid] for r, _ in used],
        )
        assert [r.draft for r, _ in used] == again

    monkeypatch.setattr(SpecDecoder, "head_proposals", comparing)
    return compared


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chained_proposals_are_the_proposals_the_next_step_would_make(
    monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    """A proposal chained behind a verify step (its acceptance counted on the device) gives each request the
    drafts `propose` gives it at the next step from the row and token the host kept; the samples stay plain
    decoding's."""
    model = _peaky_model()
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=20, seed=5, stop_token_ids=[41])
    plain = Engine(model, None, config()).generate(PEAKY_PROMPTS, params)
    head = _trained_head(model, plain)
    engine = Engine(model, None, config(speculative="head", spec_draft_tokens=3), draft_head=head)
    compared = compare_chained_proposals(monkeypatch)
    got = engine.generate(PEAKY_PROMPTS, params)
    assert_same_samples(got, plain)
    m = engine.metrics()
    assert sum(compared) == m["rollout/spec_chained_drafts"] > 20
    assert m["rollout/spec_accepted_tokens"] > 0.3 * m["rollout/spec_draft_tokens"]


def test_draft_heads_save_load_and_refuse_other_models(tmp_path) -> None:  # noqa: ANN001
    model = tiny_model(False, seed=1)
    head = new_draft_head(model.args, 0, torch.float32, torch.device("cpu"), seed=4)
    assert head.args.intermediate_size == model.args.intermediate_size
    with torch.no_grad():
        head.mlp.down_proj.weight.normal_()
    folder = save_draft_head(head, tmp_path / "head")
    assert sorted(p.name for p in folder.iterdir()) == [HEAD_CONFIG, "model.safetensors"]
    loaded = load_draft_head(folder, torch.float32, torch.device("cpu"))
    assert loaded.args == head.args
    for a, b in zip(head.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    engine = Engine(model, None, config(speculative="head", spec_head=str(folder)))
    assert engine.draft_head is not None and torch.equal(engine.draft_head.fc.weight, head.fc.weight)
    other = tiny_model(False, seed=1, hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="drafts only for the model"):
        Engine(other, None, config(speculative="head", spec_head=str(folder)))
    with pytest.raises(FileNotFoundError, match="not a draft head folder"):
        load_draft_head(tmp_path, torch.float32, torch.device("cpu"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / HEAD_CONFIG).write_text(json.dumps({**json.loads((folder / HEAD_CONFIG).read_text())}))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(1)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="does not hold a draft head"):
        load_draft_head(bad, torch.float32, torch.device("cpu"))


def test_a_new_head_starts_as_a_mix_of_its_inputs() -> None:
    """The MLP's output projection starts at zero, so the first steps of training see a plain map."""
    head = DraftHead(DraftHeadArgs(16, 32, 50))
    head.init_weights(torch.Generator().manual_seed(0))
    assert not head.mlp.down_proj.weight.any()
    x, e = torch.randn(3, 16), torch.randn(3, 16)
    expected = head.norm(head.fc(torch.cat((head.feature_norm(x), head.token_norm(e)), -1)))
    torch.testing.assert_close(head(x, e), expected)


def test_the_spec_gate_opens_and_closes_on_the_kept_tokens() -> None:
    """Closed below the threshold (after the first verify step says so), one probe every probe_every plain
    steps, open again once the average climbs back; always open at 0; bad settings refused."""
    gate = SpecGate(min_accept_length=1.5, probe_every=3)
    assert gate.speculate()  # nothing measured yet
    gate.record(verified=4, accepted=0)  # 1.0 token a request
    assert gate.accept_length == 1.0 and not gate.speculate()
    for _ in range(3):
        assert not gate.speculate()
        gate.record(0, 0)
    assert gate.speculate()  # the probe, which fails: the next one waits twice as long
    gate.record(verified=2, accepted=0)
    for _ in range(6):
        assert not gate.speculate()
        gate.record(0, 0)
    assert gate.speculate()
    gate.record(verified=4, accepted=12)  # 4.0: the average 0.5 * 1.0 + 0.5 * 4.0 = 2.5
    assert gate.accept_length == 2.5 and gate.speculate() and gate.plain_steps == 0
    assert gate.wait == 3  # open again: back to probe_every
    for _ in range(8):  # failed probes wait at most 16 * probe_every
        gate.record(verified=1, accepted=0)
        while not gate.speculate():
            gate.record(0, 0)
    assert gate.wait == 48
    gate.reset()  # new weights: measured at once
    assert gate.accept_length is None and gate.speculate() and gate.wait == 3
    assert SpecGate(0.0, 3).speculate()
    with pytest.raises(ValueError, match="spec_probe_every"):
        SpecGate(1.5, 0)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_gated_head_decodes_plain_steps_between_probes(overlap: str) -> None:
    """A new head keeps ~1 token a verify step, below rollout.spec_min_accept_length=1.5: the engine runs plain
    decode steps (overlap-scheduled with overlap_schedule=on) and verifies only on probes, one in every
    spec_probe_every + 1 decode steps; the samples stay plain decoding's. A trained head keeps the gate open."""
    model = _peaky_model()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=5, stop_token_ids=[41])
    plain = Engine(model, None, config()).generate(PEAKY_PROMPTS, params)
    gated = dict(speculative="head", spec_draft_tokens=3, spec_min_accept_length=1.5, spec_probe_every=4)
    engine = Engine(model, None, config(overlap_schedule=overlap, **gated))
    assert engine.overlap == (overlap == "on")
    got = engine.generate(PEAKY_PROMPTS, params)
    assert_same_samples(got, plain)
    decode_steps, m = engine.stats.decode_steps, engine.metrics()
    assert engine.spec.gate.accept_length is not None and engine.spec.gate.accept_length < 1.5
    verify_steps = decode_steps - m["rollout/spec_gated_steps"]
    assert 0 < verify_steps <= 2 + decode_steps / 5 and m["rollout/spec_steps"] > 0
    # A trained head keeps ~2.2 tokens a step: open but for the last few requests' steps.
    trained = Engine(model, None, config(**gated), draft_head=_trained_head(model, plain))
    assert_same_samples(trained.generate(PEAKY_PROMPTS, params), plain)
    decode_steps, m = trained.stats.decode_steps, trained.metrics()
    assert m["rollout/spec_accept_length"] > 1.5 and m["rollout/spec_gated_steps"] <= 0.2 * decode_steps
