"""rollout.release_weights_during_train (rollout/weights_region.py): the parameters' move into reserved virtual
memory, and on the GPU a release that frees their memory, a resume at the same addresses with the CUDA graphs
kept, and a weight sync that fills them again."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from miles.config import RolloutConfig
from miles.models import CausalLM
from miles.rollout import Engine, SamplingParams
from miles.rollout.kv.virtual_memory import VirtualRegion
from miles.rollout.weights_region import plan_buckets, storage_span
from tests.support.models import count_graph_captures, gpu_model, tiny_model

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)] + [[7] * 70]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def test_buckets_keep_the_order_take_a_tied_parameter_once_and_a_large_one_alone() -> None:
    model = tiny_model(tie_word_embeddings=True)
    named = list(model.named_parameters(remove_duplicate=False))
    assert named[-1][0] == "lm_head.weight" and named[-1][1] is named[0][1]  # the LM head is the embedding
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    limit = 40_000  # above the embedding's 24576 bytes, below an MLP's gate_up (65536)
    buckets = [[n for n, _ in bucket] for bucket in plan_buckets(named, limit)]
    assert [n for bucket in buckets for n in bucket] == list(sizes)  # in order, each once, by its first name
    for bucket, following in zip(buckets, buckets[1:]):  # full: the next one would not have fitted
        assert sum(sizes[n] for n in bucket) + sizes[following[0]] > limit
    for bucket in buckets:
        assert sum(sizes[n] for n in bucket) <= limit or len(bucket) == 1, bucket
    assert ["model.layers.0.mlp.gate_up_proj.weight"] in buckets
    transposed = torch.zeros(4, 6).t()  # a strided layout keeps its extent, not just its elements
    assert storage_span(transposed) == 24 and storage_span(torch.zeros(0, 3)) == 0
    assert storage_span(torch.zeros(10)[::3]) == 10


def test_an_engine_on_cpu_refuses_to_release_its_weights() -> None:
    cfg = RolloutConfig(kv_cache_bytes=1 << 20, release_weights_during_train=True)
    with pytest.raises(ValueError, match="set rollout.release_weights_during_train=false"):
        Engine(tiny_model(), None, cfg)


class _HostRegion:
    """A CPU stand-in for `VirtualRegion` (the same carving): `unmap()` fills the bytes with 0xFF, a NaN in
    every float dtype, as memory mapped back holds whatever it held; the engine must not compute on it."""

    bytes_for = staticmethod(VirtualRegion.bytes_for)

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.nbytes, self.address, self.mapped, self._carved = nbytes, self.buffer.data_ptr(), True, 0

    def carve(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = VirtualRegion.bytes_for([(dtype, shape)])
        offset = -(-self._carved // 256) * 256  # virtual_memory's alignment
        self._carved = offset + nbytes
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def unmap(self) -> None:
        self.mapped = False
        self.buffer.fill_(0xFF)

    def map(self) -> None:
        self.mapped = True


def test_the_engine_runs_again_only_once_every_parameter_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's side on CPU, over a stand-in region: released weights refuse generation and writes; back,
    they refuse generation until every parameter is written (one is not enough); the in-process sync writes
    them all (checksums hold) and the engine then draws what it drew before."""
    from miles.rollout import weights_region
    from miles.weight_sync import InProcessWeightSync

    monkeypatch.setattr(weights_region, "VirtualRegion", _HostRegion)
    monkeypatch.setattr(weights_region.virtual_memory, "supported", lambda device: True)
    trainer_model = tiny_model(moe=True, seed=3)
    cfg = RolloutConfig(kv_cache_bytes=1 << 20, release_weights_during_train=True)
    engine = Engine(copy.deepcopy(trainer_model), None, cfg)
    region = engine.weights_region
    assert region is not None and len(region.regions) == 1
    buffer = region.regions[0].buffer
    for param in engine.model.parameters():  # every parameter lives in the region now
        assert buffer.data_ptr() <= param.data_ptr() < buffer.data_ptr() + buffer.numel()
    before = engine.generate(PROMPTS, GREEDY)
    engine.release_weights()
    sync = InProcessWeightSync(trainer_model, engine)
    for call in (lambda: engine.generate(PROMPTS[:1], GREEDY), lambda: sync.sync(version=1)):
        with pytest.raises(RuntimeError, match="resume_weights"):
            call()
    engine.resume_weights()
    assert all(torch.isnan(p).all() for p in engine.model.parameters() if p.is_floating_point())
    name, first = next(iter(trainer_model.named_parameters()))
    engine.update_weights([(name, first.detach())])
    with pytest.raises(RuntimeError, match="not written yet"):
        engine.generate(PROMPTS[:1], GREEDY)
    result = sync.sync(version=1)
    assert result.checksum_ok and not result.mismatched
    after = engine.generate(PROMPTS, GREEDY)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
    assert [s.rollout_logprobs for s in after] == [s.rollout_logprobs for s in before]


def large_gpu_model(moe: bool, seed: int) -> CausalLM:
    """Weights of ~30 MB in bf16 (well above the driver's 2 MB mapping granularity)."""
    return gpu_model(
        moe, seed, moe_intermediate_size=256, vocab_size=8192, hidden_size=512, intermediate_size=1024
    )


def free_memory() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_released_weights_come_back_at_their_addresses_and_the_sync_fills_them(
    moe: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine with a copy of its own (as beside the megatron backend) and CUDA graphs: the release gives its
    weights' memory back, the resume maps memory at the same addresses, the engine refuses to run until a sync
    wrote every parameter, and the graphs (not captured again) then decode with the synced weights: other
    weights give other tokens, the trainer's again the first run's tokens and logprobs, bit for bit."""
    from miles.weight_sync import InProcessWeightSync

    captures = count_graph_captures(monkeypatch)
    trainer_model, other = large_gpu_model(moe, seed=9), large_gpu_model(moe, seed=10)
    cfg = RolloutConfig(
        backend="flashinfer",
        kv_cache_fraction=0.02,
        max_batch_tokens=64,
        max_running_requests=32,
        cuda_graph=True,
        release_weights_during_train=True,
    )
    engine = Engine(copy.deepcopy(trainer_model), None, cfg)
    region = engine.weights_region
    assert region is not None
    params = list(engine.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    assert region.nbytes == weight_bytes and region.mapped_bytes >= weight_bytes
    spans = [(r.address, r.address + r.nbytes) for r in region.regions]
    assert all(any(lo <= p.data_ptr() < hi for lo, hi in spans) for p in params)
    before = engine.generate(PROMPTS, GREEDY)
    assert captures == [1]
    addresses = [p.data_ptr() for p in params]
    sync_to = InProcessWeightSync(trainer_model, engine)

    held = free_memory()
    mapped = region.mapped_bytes
    assert engine.outside_allocator_peak() >= mapped  # restarts from what it holds now
    engine.release_weights()
    released = free_memory()
    assert released - held >= 0.99 * weight_bytes, "the release freed no memory"
    assert region.mapped_bytes == 0
    assert engine.outside_allocator_peak() == mapped + engine.pool.bytes_outside_allocator  # held earlier
    assert engine.outside_allocator_peak() == engine.pool.bytes_outside_allocator  # and no longer
    with pytest.raises(RuntimeError, match="resume_weights"):
        engine.generate(PROMPTS[:1], GREEDY)
    with pytest.raises(RuntimeError, match="resume_weights"):
        sync_to.sync(version=1)
    junk = torch.full((weight_bytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")  # reuse bait
    del junk
    engine.resume_weights()
    assert released - free_memory() >= 0.99 * weight_bytes, "the resume took no memory"
    assert engine.outside_allocator_peak() >= mapped
    assert [p.data_ptr() for p in params] == addresses
    with pytest.raises(RuntimeError, match="not written yet"):
        engine.generate(PROMPTS[:1], GREEDY)
    name, first = next(iter(other.named_parameters()))
    engine.update_weights([(name, first.detach())])  # one parameter of many: still refused
    with pytest.raises(RuntimeError, match="not written yet"):
        engine.generate(PROMPTS[:1], GREEDY)

    result = InProcessWeightSync(other, engine).sync(version=1)
    assert result.checksum_ok and not result.mismatched and result.bytes == weight_bytes
    changed = engine.generate(PROMPTS, GREEDY)
    assert [s.response_ids for s in changed] != [s.response_ids for s in before], (
        "the graphs read old weights"
    )

    engine.release_weights()
    engine.resume_weights()
    result = sync_to.sync(version=2)
    assert result.checksum_ok and not result.mismatched
    after = engine.generate(PROMPTS, GREEDY)
    assert captures == [1], "the graphs were captured again"
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
    assert [s.rollout_logprobs for s in after] == [s.rollout_logprobs for s in before]
