"""Engine API: weight updates and cache flush, memory release, stops, seeds, deterministic mode, routing."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from miles.config import RolloutConfig
from miles.models import RoutingTrace
from miles.models.checkpoint import internal_to_hf
from miles.rollout import Engine, SamplingParams
from miles.sample import Sample, SampleStatus
from tests.support.models import rollout_config, tiny_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


pytestmark = pytest.mark.usefixtures("overlap_mode")


def config(**overrides: object) -> RolloutConfig:
    return rollout_config(
        dict(kv_cache_bytes=4 * 1024 * 1024, max_batch_tokens=256, max_running_requests=32), overrides
    )


PROMPTS = [[3, 14, 15, 92, 65, 35], [2, 71, 82], [9, 9, 8, 7, 6, 5, 4, 3, 2, 1]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


class LetterTokenizer:
    """Token t decodes to one letter; enough for the engine's stop-string handling."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_update_weights_changes_outputs_and_flushes_the_cache(moe: bool) -> None:
    model = tiny_model(moe)
    engine = Engine(model, None, config())
    before = [s.response_ids for s in engine.generate(PROMPTS, GREEDY)]
    assert engine.kv.tree is not None and engine.kv.tree.total_size > 0
    new = tiny_model(moe, seed=1)
    # HF names (per-expert tensors for MoE) in two buckets, as weight_sync sends them.
    named = list(internal_to_hf(new.state_dict(), new.args))
    engine.update_weights([named[: len(named) // 2], dict(named[len(named) // 2 :])], version=7)
    assert engine.weight_version == 7
    assert engine.kv.tree.total_size == 0, "the radix cache must not keep KV computed by the old weights"
    after = engine.generate(PROMPTS, GREEDY)
    assert all(s.weight_version == 7 for s in after)
    fresh = [s.response_ids for s in Engine(new, None, config()).generate(PROMPTS, GREEDY)]
    assert [s.response_ids for s in after] == fresh
    assert fresh != before
    with pytest.raises(KeyError, match="has no place"):
        engine.update_weights({"model.nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)})


@pytest.mark.parametrize("policy", ["retract", "finish"])
def test_update_weights_with_requests_in_flight(policy: str) -> None:
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    on_old = [s.response_ids for s in Engine(tiny_model(seed=0), None, config()).generate(PROMPTS, GREEDY)]
    on_new = [s.response_ids for s in Engine(new, None, config()).generate(PROMPTS, GREEDY)]
    engine = Engine(old, None, config(update_policy=policy))
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    engine.update_weights(new.state_dict(), version=1)
    while engine.has_unfinished:
        engine.step()
    results = [engine.take_result(r) for r in rids]
    if policy == "retract":  # restarted from the prompt on the new weights
        assert [s.response_ids for s in results] == on_new and all(s.weight_version == 1 for s in results)
    else:  # finished on the old weights before the update
        assert [s.response_ids for s in results] == on_old and all(s.weight_version == 0 for s in results)


def test_release_and_resume_memory() -> None:
    engine = Engine(tiny_model(), None, config())
    before = engine.generate(PROMPTS, GREEDY)
    engine.release_memory()
    assert engine.pool.k_cache is None and not engine.pool.allocated
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume_memory()
    assert [s.response_ids for s in engine.generate(PROMPTS, GREEDY)] == [s.response_ids for s in before]
    # Colocated training: weights change while the KV memory is released.
    new = tiny_model(seed=1)
    engine.release_memory()
    engine.update_weights(new.state_dict(), version=3)
    engine.resume_memory()
    fresh = Engine(new, None, config()).generate(PROMPTS, GREEDY)
    assert [s.response_ids for s in engine.generate(PROMPTS, GREEDY)] == [s.response_ids for s in fresh]


def test_kv_virtual_memory_is_checked_and_stays_off_the_cpu() -> None:
    """The CPU pool is plain torch memory whatever the setting (its driver structs: in the GPU test); a wrong
    value is refused by name."""
    import ctypes

    from miles.rollout.kv import virtual_memory

    with pytest.raises(ValueError, match="kv_virtual_memory"):
        Engine(tiny_model(), None, config(kv_virtual_memory="yes"))
    engine = Engine(tiny_model(), None, config(kv_virtual_memory="on"))
    assert not engine.pool.keeps_addresses and engine.pool.bytes_outside_allocator == 0
    assert not virtual_memory.supported(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="kv_virtual_memory=off"):
        virtual_memory.VirtualRegion(1 << 20, torch.device("cpu"))
    # CUmemAllocationProp and CUmemAccessDesc as the driver lays them out (cuda.h, 64-bit Linux).
    assert ctypes.sizeof(virtual_memory._AllocationProp) == 32
    assert virtual_memory._AllocationProp.win32_handle_meta_data.offset == 16
    assert ctypes.sizeof(virtual_memory._AccessDesc) == 12
    # Tensors carved from a region start 256-byte aligned, like cudaMalloc's.
    shapes = [(torch.bfloat16, (3,)), (torch.int16, (2, 5))]
    assert virtual_memory.VirtualRegion.bytes_for(shapes) == 256 + 20


def test_stop_token_ids_eos_and_ignore_eos() -> None:
    model = tiny_model()
    engine = Engine(model, None, config())
    (ref,) = engine.generate([PROMPTS[0]], GREEDY)
    stop = ref.response_ids[3]
    cut = ref.response_ids.index(stop) + 1
    (s,) = engine.generate([PROMPTS[0]], GREEDY.with_(stop_token_ids=[stop]))
    assert s.response_ids == ref.response_ids[:cut] and s.status == SampleStatus.COMPLETED
    model.args.eos_token_id = stop
    eos_engine = Engine(model, None, config())
    (s,) = eos_engine.generate([PROMPTS[0]], GREEDY)
    assert s.response_ids == ref.response_ids[:cut] and s.status == SampleStatus.COMPLETED
    (s,) = eos_engine.generate([PROMPTS[0]], GREEDY.with_(ignore_eos=True))
    assert s.response_ids == ref.response_ids and s.status == SampleStatus.TRUNCATED


def test_stop_strings_cut_the_text() -> None:
    engine = Engine(tiny_model(), LetterTokenizer(), config())
    (ref,) = engine.generate([PROMPTS[2]], GREEDY)
    assert ref.response_text == LetterTokenizer().decode(ref.response_ids)
    stop = ref.response_text[4:6]
    first = ref.response_text.find(stop)
    (s,) = engine.generate([PROMPTS[2]], GREEDY.with_(stop=[stop, "zzzzzz"]))
    assert s.status == SampleStatus.COMPLETED
    assert s.response_text == ref.response_text[:first]
    assert s.response_ids == ref.response_ids[: first + len(stop)]
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(tiny_model(), None, config()).generate([PROMPTS[0]], GREEDY.with_(stop=["x"]))


def test_seeded_samples_do_not_depend_on_the_batch() -> None:
    engine = Engine(tiny_model(), None, config())
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=1234)
    alone = engine.generate([PROMPTS[0]], params)
    crowded = engine.generate([PROMPTS[2], PROMPTS[1], PROMPTS[0]], params)
    assert [s.response_ids for s in alone] == [s.response_ids for s in crowded[8:]]
    assert len({tuple(s.response_ids) for s in alone}) > 1
    unseeded = engine.generate([PROMPTS[0]], params.with_(seed=None))
    assert [s.response_ids for s in unseeded] != [s.response_ids for s in alone]


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_deterministic_mode_is_batch_invariant(moe: bool) -> None:
    model = tiny_model(moe, seed=4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    alone = Engine(model, None, config(deterministic=True)).generate([PROMPTS[2]], params)
    # Different batch composition, chunking and cache state.
    busy = Engine(model, None, config(deterministic=True, max_batch_tokens=5, max_running_requests=5))
    busy.generate([PROMPTS[2][:4]], params)
    crowded = busy.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], params)[2:4]
    for a, b in zip(alone, crowded):
        assert a.response_ids == b.response_ids
        assert a.rollout_logprobs == b.rollout_logprobs  # bit for bit


def test_seeded_samples_depend_on_their_prompt_not_on_its_position() -> None:
    """One seed for a batch (as the RL loop samples): a prompt draws the same wherever it sits, and
    different prompts do not share random numbers (the seed mixes in the prompt's tokens)."""
    model = tiny_model(False, seed=1)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    first, second = PROMPTS[0], PROMPTS[2]
    forward = Engine(model, None, config()).generate([first, second], params)
    backward = Engine(model, None, config()).generate([second, first], params)
    assert [s.response_ids for s in forward] == [s.response_ids for s in backward[2:] + backward[:2]]
    engine = Engine(model, None, config())
    rids = [engine.add_request(prompt, params.with_(n=1), index=0) for prompt in (first, second, list(first))]
    seeds = [engine._requests[rid].seed for rid in rids]
    assert seeds[0] != seeds[1] and seeds[0] == seeds[2]


def test_routing_is_recorded_per_fed_token() -> None:
    model = tiny_model(moe=True, seed=5)
    engine = Engine(model, None, config(max_batch_tokens=8, max_running_requests=8, record_routing=True))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=9, return_routing=True)
    for _ in range(2):  # the second round reuses cached prefixes (their routing comes from the slot store)
        for s in engine.generate(PROMPTS, params):
            ids = s.prompt_ids + s.response_ids
            trace = RoutingTrace(record=True)
            with torch.no_grad():
                from miles.models.attention import VarlenAttention

                model.forward_packed(
                    torch.tensor(ids), torch.arange(len(ids)), VarlenAttention([0, len(ids)]), trace
                )
            expected = trace.stacked()[:, :-1].permute(1, 0, 2).tolist()  # prompt + response minus the last
            assert s.routed_experts.dtype == torch.int16  # compact: not nested lists
            assert s.routed_experts.tolist() == expected
    (plain,) = engine.generate([PROMPTS[0]], params.with_(n=1, return_routing=False))
    assert plain.routed_experts is None


def test_routing_is_recorded_only_when_configured() -> None:
    """Without rollout.record_routing the pool has no routing store and no step writes one; a request that
    asks for its routing then gets an error that says what to set, not a sample without it."""
    model = tiny_model(moe=True, seed=5)
    engine = Engine(model, None, config())
    assert engine.pool.routing is None
    with pytest.raises(ValueError, match="rollout.record_routing=true"):
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2, return_routing=True))
    (plain,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    assert plain.routed_experts is None and len(plain.response_ids) == 2
    dense = Engine(tiny_model(), None, config())  # nothing to record: routed_experts stays None
    (sample,) = dense.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2, return_routing=True))
    assert sample.routed_experts is None


def test_sample_inputs_carry_their_fields() -> None:
    engine = Engine(tiny_model(), None, config())
    src = Sample(
        prompt="two plus two", prompt_ids=PROMPTS[1], label="4", metadata={"data_source": "x"}, group_id=42
    )
    out = engine.generate([src], GREEDY.with_(n=2))
    assert [(s.group_id, s.index, s.label, s.prompt) for s in out] == [
        (42, 0, "4", "two plus two"),
        (42, 1, "4", "two plus two"),
    ]
    assert out[0].metadata == {"data_source": "x"} and out[0].metadata is not src.metadata
    assert out[0].loss_mask == [1] * len(out[0].response_ids)
    # Prompt ids given as numpy or torch scalars come back (and run) as Python ints.
    for ids in (list(np.array(PROMPTS[1])), list(torch.tensor(PROMPTS[1]))):
        scalars = engine.generate([Sample(prompt="", prompt_ids=ids)], GREEDY)
        assert scalars[0].prompt_ids == PROMPTS[1] and type(scalars[0].prompt_ids[0]) is int
        assert scalars[0].response_ids == out[0].response_ids


def test_metrics_names() -> None:
    engine = Engine(tiny_model(), None, config())
    engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4))
    metrics = engine.metrics()
    for name in (
        "rollout/tokens_per_s",
        "rollout/prefix_hit_rate",
        "rollout/cache_usage",
        "rollout/preemptions",
        "rollout/device_wait_s",
    ):
        assert name in metrics
    assert metrics["rollout/output_tokens"] == 24 and metrics["rollout/tokens_per_s"] > 0
    assert engine.metrics()["rollout/output_tokens"] == 0  # reset on read


def test_flashinfer_page_table_metadata() -> None:
    from miles.rollout.attention.flashinfer_backend import paged_kv_metadata
    from miles.rollout.kv.pool import RequestTable

    table = RequestTable(4, 64, torch.device("cpu"))
    page = 4
    table.table[2, :10] = torch.tensor([8, 9, 10, 11, 40, 41, 42, 43, 20, 21], dtype=torch.int32)
    table.table[0, :4] = torch.tensor([4, 5, 6, 7], dtype=torch.int32)
    indptr, indices, last = paged_kv_metadata(table, [2, 0], [10, 4], page)
    assert indptr.tolist() == [0, 3, 4] and indices.tolist() == [2, 10, 5, 1] and last.tolist() == [2, 4]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    indptr, indices, last = paged_kv_metadata(table, [0, 2], [3, 6], 1)  # page size 1: the slots themselves
    assert indptr.tolist() == [0, 3, 9] and indices.tolist() == [4, 5, 6, 8, 9, 10, 11, 40, 41]
    assert last.tolist() == [1, 1] and indices.dtype == torch.int32


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` takes flashinfer only where its kernels run (CUDA, bf16/fp16, a head size they are built for);
    asking for it elsewhere is an error that names the way out."""
    import importlib.util

    from miles.rollout.model_runner import resolve_backend

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if flashinfer were installed
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    assert resolve_backend("auto", cuda, bf16, 128) == "flashinfer"
    assert resolve_backend("auto", cuda, bf16, 16) == "torch"  # the tiny models' head size
    assert resolve_backend("auto", cuda, torch.float32, 128) == "torch"
    assert resolve_backend("auto", cpu, bf16, 128) == "torch"
    with pytest.raises(ValueError, match="head_dim 64, 128, 256, not 16; use rollout.backend=torch"):
        resolve_backend("flashinfer", cuda, bf16, 16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("flashinfer", cpu, bf16, 128)
    with pytest.raises(ValueError, match="must be auto, torch or flashinfer"):
        resolve_backend("triton", cuda, bf16, 128)


def test_graph_inputs_and_page_table_pad_to_the_bucket() -> None:
    """A graph replay's static inputs and page table: the batch's rows, then padding rows (position 0, slot
    0) and padding requests holding `tokens` tokens on page 0, for decode (1) and verify (3) rows per request.
    (The graphs themselves need a GPU; this is the host side that fills them.)"""
    from types import SimpleNamespace

    from miles.rollout.cuda_graph import CudaGraphRunner
    from miles.rollout.forward_batch import ForwardBatch
    from miles.rollout.kv.pool import RequestTable

    table = RequestTable(4, 64, torch.device("cpu"))
    table.table[2, :12] = torch.arange(40, 52, dtype=torch.int32)
    table.table[0, :6] = torch.arange(8, 14, dtype=torch.int32)
    graphs = object.__new__(CudaGraphRunner)
    runner = SimpleNamespace(table=table, pool=SimpleNamespace(page_size=4))
    graphs._runner = lambda: runner  # what the weak reference to the model runner returns
    graphs.valid_rows = torch.zeros(1, dtype=torch.int32)
    for rows_per_request in (1, 3):
        real = 2 * rows_per_request
        batch = ForwardBatch(
            input_ids=torch.arange(1, real + 1),
            positions=torch.arange(10, 10 + real),
            out_slots=torch.arange(20, 20 + real),
            rows=[2, 0],
            q_lens=[rows_per_request] * 2,
            kv_lens=[12, 6],
            sample_index=torch.arange(real),
        )
        n = 4 * rows_per_request
        ids, positions, slots = (torch.full((n + 2,), -1) for _ in range(3))
        graphs._fill_inputs(batch, n, ids, positions, slots)
        assert ids[:n].tolist() == list(range(1, real + 1)) + [0] * (n - real)
        assert slots[:n].tolist() == list(range(20, 20 + real)) + [0] * (n - real)
        assert positions[n:].tolist() == [-1, -1] and int(graphs.valid_rows) == real
        indptr, indices, last = graphs._page_table(batch, 4, rows_per_request)
        assert indptr.tolist() == [0, 3, 5, 6, 7] and indices.tolist() == [10, 11, 12, 2, 3, 0, 0]
        assert last.tolist() == [4, 2, rows_per_request, rows_per_request]


def test_graph_decode_wrappers_take_the_chosen_kernel() -> None:
    """Graph decode wrappers decode on the chosen path; verify wrappers (several rows per request) always on
    tensor cores. (flashinfer itself is stood in for: this checks the arguments the engine passes.)"""
    from types import SimpleNamespace

    from miles.rollout.attention.flashinfer_backend import FlashinferBackend

    made: list[dict[str, object]] = []
    backend = object.__new__(FlashinferBackend)  # without flashinfer, which a CPU install lacks
    backend.flashinfer = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=lambda *a, **kw: made.append(kw))
    backend.workspace, backend.kernel = torch.zeros(1), "fa2"
    buffers = (
        torch.zeros(9, dtype=torch.int32),
        torch.zeros(64, dtype=torch.int32),
        torch.zeros(8, dtype=torch.int32),
    )
    for tensor_cores in (False, True):
        backend.decode_tensor_cores = tensor_cores
        backend.graph_decode_wrapper(4, *buffers)
        backend.graph_decode_wrapper(4, *buffers, rows_per_request=5)
    assert [kw["use_tensor_cores"] for kw in made] == [False, True, True, True]
    assert all(kw["use_cuda_graph"] and len(kw["paged_kv_indptr_buffer"]) == 5 for kw in made)  # type: ignore[arg-type]
    assert all(len(kw["paged_kv_last_page_len_buffer"]) == 4 for kw in made)  # type: ignore[arg-type]


def test_verify_graph_padding_and_flashinfer_version() -> None:
    """The padding requests of a verify graph hold `tokens` tokens each on page 0 (flashinfer's page-table
    form: host indptr, indices, last-page lengths), after the real ones; verify graphs need the flashinfer
    release they were tested on."""
    from miles.rollout.cuda_graph import _padding_requests, verified_flashinfer

    real_indptr = torch.tensor([0, 3, 4], dtype=torch.int32)
    real_indices, real_last = (
        torch.tensor([7, 8, 9, 5], dtype=torch.int32),
        torch.tensor([2, 16], dtype=torch.int32),
    )
    for page, tokens in [(1, 5), (16, 5), (16, 16), (16, 17), (4, 20)]:
        indptr, indices, last = _padding_requests(
            real_indptr, 3, tokens, page, torch.device("cpu"), real_indices, real_last
        )
        pages = -(-tokens // page)
        assert indptr.tolist() == [0, 3, 4, 4 + pages, 4 + 2 * pages, 4 + 3 * pages]
        assert indices.tolist() == [7, 8, 9, 5] + [0] * (3 * pages)
        assert last.tolist() == [2, 16] + [tokens - (pages - 1) * page] * 3
        assert all(1 <= n <= page for n in last.tolist()[2:])
    assert verified_flashinfer("0.6.18.post1") and verified_flashinfer("0.7.0rc1")
    assert not verified_flashinfer("0.6.17") and not verified_flashinfer("0.5.3")


def test_decode_kernel_choice() -> None:
    """`rollout.flashinfer_decode=auto` decodes on tensor cores from 4 query heads per KV head (and always with
    fa3), on CUDA cores below; a bad value fails when the engine is built, on CPU too."""
    from miles.rollout.attention.flashinfer_backend import decode_uses_tensor_cores

    assert decode_uses_tensor_cores("auto", "fa2", 4) and decode_uses_tensor_cores("auto", "fa2", 8)
    assert not decode_uses_tensor_cores("auto", "fa2", 2) and not decode_uses_tensor_cores("auto", "fa2", 1)
    assert decode_uses_tensor_cores("auto", "fa3", 2)
    assert decode_uses_tensor_cores("tensor-cores", "fa2", 1)
    assert not decode_uses_tensor_cores("cuda-cores", "fa2", 8)
    with pytest.raises(ValueError, match="no fa3 form: use rollout.flashinfer_kernel=fa2"):
        decode_uses_tensor_cores("cuda-cores", "fa3", 2)
    with pytest.raises(ValueError, match="flashinfer_decode must be one of auto, tensor-cores, cuda-cores"):
        Engine(tiny_model(False), None, RolloutConfig(flashinfer_decode="tensor_cores"))


def test_context_length_takes_yarn_s_factor_and_rollout_max_context_caps_it() -> None:
    from miles.models import ModelArgs

    qwen_long = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert ModelArgs(max_position_embeddings=40960, rope_scaling=qwen_long).context_length == 131072
    assert ModelArgs(max_position_embeddings=40960).context_length == 40960
    assert (  # without the original context (vLLM refuses such a config): not extended
        ModelArgs(
            max_position_embeddings=64, rope_scaling={"rope_type": "yarn", "factor": 2.0}
        ).context_length
        == 64
    )
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    model = tiny_model(False, seed=1, max_position_embeddings=32, rope_scaling=yarn)
    engine = Engine(model, None, config())
    assert engine.max_context == 64
    (long,) = engine.generate([list(range(1, 41))], GREEDY.with_(max_new_tokens=30))  # past position 32
    assert long.status == SampleStatus.TRUNCATED and len(long.response_ids) == 64 - 40
    capped = Engine(model, None, config(max_context=48))
    (short,) = capped.generate([list(range(1, 41))], GREEDY.with_(max_new_tokens=30))
    assert len(short.response_ids) == 48 - 40 and short.response_ids == long.response_ids[:8]
    (refused,) = capped.generate([list(range(1, 50))], GREEDY)
    assert refused.status == SampleStatus.ABORTED and "rollout.max_context" in refused.metadata["error"]
    with pytest.raises(ValueError, match="rollout.max_context must be in"):
        Engine(model, None, config(max_context=65))


def test_engine_state_carries_the_seeds_of_unseeded_requests() -> None:
    """Unseeded requests draw their seeds from a counter; a resumed run restores it, so they draw again as
    the interrupted run would have."""
    model = tiny_model(False, seed=1)
    unseeded = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    first = Engine(model, None, config())
    first.generate(PROMPTS, unseeded)
    state = first.state_dict()
    expected = first.generate(PROMPTS, unseeded)
    resumed = Engine(model, None, config())
    resumed.load_state_dict(state)
    assert [s.response_ids for s in resumed.generate(PROMPTS, unseeded)] == [s.response_ids for s in expected]
    assert [s.response_ids for s in Engine(model, None, config()).generate(PROMPTS, unseeded)] != [
        s.response_ids for s in expected
    ]


def test_generate_reports_each_sample_as_it_finishes() -> None:
    """`on_finish` gets every sample once, the same object generate returns, between engine steps: a prompt
    refused at once is reported before any step runs."""
    engine = Engine(tiny_model(), None, config(max_context=48))
    steps = []
    step = engine.step

    def counted_step():
        steps.append(1)
        return step()

    engine.step = counted_step  # type: ignore[method-assign]
    reported: list[tuple[Sample, int]] = []
    prompts = [list(range(1, 50)), *PROMPTS]  # the first is longer than rollout.max_context
    out = engine.generate(prompts, GREEDY.with_(n=2), on_finish=lambda s: reported.append((s, len(steps))))
    assert len(reported) == len(out) == 8
    assert {id(s) for s, _ in reported} == {id(s) for s in out}
    refused = [n for s, n in reported if s.status == SampleStatus.ABORTED]
    assert refused == [0, 0]
    assert max(n for _, n in reported) == len(steps)  # the last reported right after the last step


def test_a_failing_on_finish_aborts_its_call_and_leaves_the_engine_clean() -> None:
    engine = Engine(tiny_model(), None, config())
    before = engine.generate(PROMPTS, GREEDY)

    def fail(sample: Sample) -> None:
        raise ValueError("grader exploded")

    with pytest.raises(ValueError, match="grader exploded"):
        engine.generate(PROMPTS, GREEDY.with_(n=2), on_finish=fail)
    assert not engine.has_unfinished and not engine._results  # nothing left for a later call to find
    assert [s.response_ids for s in engine.generate(PROMPTS, GREEDY)] == [s.response_ids for s in before]


def test_chat_message_prompts_are_tokenized_by_the_chat_template() -> None:
    """A Sample of chat messages without prompt_ids is rendered by the tokenizer's chat template (under
    transformers 5 `apply_chat_template(tokenize=True)` returns a BatchEncoding, whose keys are no ids)."""
    from miles.model_io import load_model

    loaded = load_model("builtin:tiny_moe_math", "float32", "cpu")
    tokenizer = loaded.tokenizer
    engine = Engine(loaded.model, tokenizer, config())
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    (out,) = engine.generate([Sample(prompt=messages)], GREEDY)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.status != SampleStatus.ABORTED and out.response_ids


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(speculative="yes"), "rollout.speculative must be off, ngram, draft or head"),
        (dict(page_size=0), "rollout.page_size must be >= 1"),
        (dict(cuda_graph_piecewise_min_batch=-1), "rollout.cuda_graph_piecewise_min_batch must be >= 0"),
        (dict(max_batch_tokens=0), "rollout.max_batch_tokens must be >= 1"),
        (dict(max_running_requests=8, max_batch_tokens=4), "must not exceed rollout.max_batch_tokens"),
        (dict(overlap_schedule="sometimes"), "rollout.overlap_schedule must be auto, on or off"),
        (dict(fused_kernels="maybe"), "rollout.fused_kernels must be auto, on or off"),
        (dict(update_policy="keep"), "rollout.update_policy must be finish or retract"),
        (dict(flashinfer_decode="fast"), "rollout.flashinfer_decode must be one of"),
        (dict(speculative="ngram", spec_draft_tokens=0), "rollout.spec_draft_tokens must be >= 1"),
        (dict(spec_ngram_min=3, spec_ngram_max=2), "n-gram sizes need 1 <= n_min <= n_max"),
        (dict(spec_probe_every=0), "rollout.spec_probe_every >= 1"),
        (dict(max_context=1), "rollout.max_context must be in"),
    ],
)
def test_the_config_check_refuses_what_the_engine_refuses(overrides: dict[str, object], message: str) -> None:
    """`check_rollout_config` (what start-time validation runs, before any model loads) raises what the
    engine would, with the same message; `max_context` is checked against a context length only given one."""
    from miles.rollout.checks import check_rollout_config

    model = tiny_model()
    cfg = config(**overrides)
    with pytest.raises(ValueError, match=message):
        check_rollout_config(cfg, model.args.context_length)
    with pytest.raises(ValueError, match=message):
        Engine(model, None, cfg)
    if "max_context" in overrides:
        check_rollout_config(cfg)


def test_sampling_params_from_config_are_the_rl_loops() -> None:
    """`SamplingParams.from_config`: every field the RL loop sets, from the rollout config, the end ids and
    the seed; `overrides` replace any field."""
    cfg = RolloutConfig(
        n_samples_per_prompt=4, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_new_tokens=64
    )
    cfg.stop, cfg.record_routing = ["</answer>"], True
    params = SamplingParams.from_config(cfg, stop_token_ids=[2, 7])
    assert params == SamplingParams(
        n=4,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        max_new_tokens=64,
        stop_token_ids=[2, 7],
        stop=["</answer>"],
        return_routing=True,
    )
    assert params.seed is None and params.stop is not cfg.stop
    assert SamplingParams.from_config(cfg, seed=3, n=1).seed == 3
    assert SamplingParams.from_config(cfg, seed=3, n=1).n == 1
