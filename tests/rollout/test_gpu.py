"""GPU: flashinfer vs the torch backend, CUDA-graph decode vs eager, grouped-GEMM experts, determinism.

bf16 runs differ in rounding between kernels, so greedy outputs are compared up to the first step where the
two picks are a near-tie under a reference forward; before that, tokens must match and logprobs agree.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from miles.config import RolloutConfig, TrainerConfig
from miles.models import CausalLM, ModelArgs, fused_norm_rope
from miles.models.moe import Experts
from miles.rollout import Engine, SamplingParams
from miles.sample import Sample
from tests.support.models import count_graph_captures, gpu_model

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: these tests are skipped there
    triton = None

if triton is not None:

    @triton.jit
    def _round_bf16_all(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, fused_norm_rope._round_bf16(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


pytestmark = pytest.mark.gpu

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)] + [[7] * 70]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
NEAR_TIE = 0.25
"""Max logit gap (bf16 logits of order 1-10; MoE routing can flip on a rounding) between two picks that may
legitimately differ."""


def config(**overrides: object) -> RolloutConfig:
    cfg = RolloutConfig(
        kv_cache_fraction=0.02, max_batch_tokens=64, max_running_requests=32, cuda_graph=False
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def reference_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda"))[0, -1].float()


def assert_agree_until_near_tie(
    model: CausalLM, a: list[Sample], b: list[Sample], logprob_tol: float, near_tie: float = NEAR_TIE
) -> None:
    compared = 0
    for x, y in zip(a, b):
        for i, (tx, ty) in enumerate(zip(x.response_ids, y.response_ids)):
            if tx != ty:
                logits = reference_logits(model, x.prompt_ids + x.response_ids[:i])
                gap = float((logits[tx] - logits[ty]).abs())
                assert gap < near_tie, f"outputs diverge at step {i} with a logit gap of {gap}"
                break
            assert abs(x.rollout_logprobs[i] - y.rollout_logprobs[i]) < logprob_tol
            compared += 1
    assert compared >= 0.5 * sum(len(s.response_ids) for s in a), "too few tokens agreed to compare"


def mean_logprob_error(model32: CausalLM, samples: list[Sample]) -> float:
    """Mean |engine logprob - float32 full-forward logprob| (greedy: temperature-1 logprob of the pick)."""
    errors = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
            logits = model32(ids)[0, len(s.prompt_ids) - 1 : -1].float()
            ref = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(s.response_ids, device="cuda")[:, None]
            )
            errors.append((ref.squeeze(-1) - torch.tensor(s.rollout_logprobs, device="cuda")).abs())
    return float(torch.cat(errors).mean())


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_flashinfer_matches_the_torch_backend(moe: bool) -> None:
    model = gpu_model(moe)
    torch_out = Engine(model, None, config(backend="torch")).generate(PROMPTS, GREEDY)
    engine = Engine(model, None, config(backend="flashinfer"))
    assert engine.backend == "flashinfer"
    flash_out = engine.generate(PROMPTS, GREEDY)
    # MoE: a router near-tie flips an expert and moves the logits more than a rounding would.
    near_tie = 0.5 if moe else NEAR_TIE
    assert_agree_until_near_tie(model, torch_out, flash_out, logprob_tol=0.25, near_tie=near_tie)
    # Against float32 math, flashinfer is as close as the torch backend (both bf16).
    model32 = copy.deepcopy(model).float()
    torch_err, flash_err = mean_logprob_error(model32, torch_out), mean_logprob_error(model32, flash_out)
    assert flash_err <= 1.5 * torch_err + 0.01, (flash_err, torch_err)
    # Page size 16 and a pool of about 24 pages, small enough to preempt.
    tiny = config(backend="flashinfer", page_size=16)
    page_bytes = 16 * engine.pool.layout.bytes_per_token
    tiny.kv_cache_fraction = 24.5 * page_bytes / torch.cuda.mem_get_info()[0]
    tiny_engine = Engine(model, None, tiny)
    assert 20 <= tiny_engine.pool.num_pages <= 28
    out = tiny_engine.generate(PROMPTS, GREEDY.with_(n=2))
    assert tiny_engine.metrics()["rollout/preemptions"] > 0
    assert_agree_until_near_tie(
        model, [s for s in torch_out for _ in range(2)], out, logprob_tol=0.25, near_tie=near_tie
    )


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_cuda_graph_decode_matches_eager(moe: bool) -> None:
    model = gpu_model(moe, seed=1)
    eager = Engine(model, None, config(backend="flashinfer")).generate(PROMPTS, GREEDY.with_(n=3))
    engine = Engine(model, None, config(backend="flashinfer", cuda_graph=True))
    graphed = engine.generate(PROMPTS, GREEDY.with_(n=3))
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "decode never replayed a graph"
    assert_agree_until_near_tie(model, eager, graphed, logprob_tol=0.05)
    # Graphs point into the pool: without a kept address range (auto keeps one only with
    # release_kv_during_train) releasing and resuming memory must re-capture them.
    engine.release_memory()
    engine.resume_memory()
    assert_agree_until_near_tie(model, eager, engine.generate(PROMPTS, GREEDY.with_(n=3)), logprob_tol=0.05)


@pytest.mark.parametrize(
    ("kv_heads", "decode", "piecewise", "tensor_cores"),
    [(4, "auto", 0, False), (4, "auto", 1, False), (2, "cuda-cores", 0, False), (2, "auto", 1, True)],
    ids=["group2-whole", "group2-pieces", "group4-cuda-cores", "group4-auto"],
)
def test_decode_kernels_match_the_torch_backend(
    kv_heads: int, decode: str, piecewise: int, tensor_cores: bool
) -> None:
    """Graph decode on flashinfer's CUDA-core kernel (what `auto` picks below 4 query heads per KV head) and
    on its tensor-core kernel agrees with the torch backend, in whole graphs and in pieces, with page size 16."""
    model = gpu_model(False, seed=6, kv_heads=kv_heads)
    params = GREEDY.with_(n=2)
    torch_out = Engine(model, None, config(backend="torch", page_size=16)).generate(PROMPTS, params)
    cfg = config(
        backend="flashinfer",
        cuda_graph=True,
        cuda_graph_piecewise_min_batch=piecewise,
        flashinfer_decode=decode,
        page_size=16,
    )
    engine = Engine(model, None, cfg)
    assert engine.runner.flashinfer is not None
    assert engine.runner.flashinfer.decode_tensor_cores is tensor_cores
    out = engine.generate(PROMPTS, params)
    graphs = engine.runner.graphs
    assert graphs is not None and (graphs.pieces if piecewise else graphs.graphs), "no graph replayed"
    assert_agree_until_near_tie(model, torch_out, out, logprob_tol=0.25)


@pytest.mark.parametrize("piecewise", [0, 1], ids=["whole", "pieces"])
def test_sampler_graph_draws_what_the_eager_sampler_draws(
    piecewise: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain draw (temperature only) replayed as a CUDA graph on the decode graph's logits gives the eager
    sampler's tokens and logprobs bit for bit, through batch sizes that shrink as requests finish and a
    release/resume (new logits buffers); filtered or greedy rows keep the eager sampler."""
    from miles.rollout.cuda_graph import CudaGraphRunner

    model = gpu_model(False, seed=5)
    plain = SamplingParams(n=3, temperature=0.8, max_new_tokens=24, seed=11)
    mixed = [plain, plain.with_(top_p=0.9), plain.with_(temperature=0.0)]
    cfg = config(backend="flashinfer", cuda_graph=True, cuda_graph_piecewise_min_batch=piecewise)
    drawn: list[bool] = []
    sample = CudaGraphRunner.sample

    def counted(self: CudaGraphRunner, *args: object) -> object:
        out = sample(self, *args)  # type: ignore[arg-type]
        drawn.append(out is not None)
        return out

    monkeypatch.setattr(CudaGraphRunner, "sample", counted)
    engine = Engine(model, None, cfg)
    graphed = [engine.generate(PROMPTS, p) for p in mixed]
    engine.release_memory()
    engine.resume_memory()
    graphed.append(engine.generate(PROMPTS, plain.with_(seed=12, max_new_tokens=40)))
    assert any(drawn), "no step sampled through a graph"
    assert engine.runner.graphs is not None and engine.runner.graphs.sampler.captured
    monkeypatch.setattr(CudaGraphRunner, "sample", lambda self, logits, st: None)
    eager = Engine(model, None, cfg)
    expected = [eager.generate(PROMPTS, p) for p in mixed]
    eager.release_memory()  # as above: the release flushes the radix cache, which changes what is computed
    eager.resume_memory()
    expected.append(eager.generate(PROMPTS, plain.with_(seed=12, max_new_tokens=40)))
    for got, want in zip(graphed, expected, strict=True):
        assert [s.response_ids for s in got] == [s.response_ids for s in want]
        assert [s.rollout_logprobs for s in got] == [s.rollout_logprobs for s in want]


def test_verify_sampler_graph_draws_what_the_eager_sampler_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """With speculative decoding, the plain draw replayed as a CUDA graph on a verify graph's logits gives the
    eager sampler's tokens and logprobs bit for bit (same verify graphs on both sides)."""
    from miles.rollout.cuda_graph import CudaGraphRunner

    model = gpu_model(False, seed=7)
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=32, seed=3)
    cfg = config(backend="flashinfer", cuda_graph=True, speculative="ngram", spec_draft_tokens=3)
    drawn: list[tuple[bool, bool]] = []  # (the last replay was a verify step, sampled through a graph)
    sample = CudaGraphRunner.sample

    def counted(self: CudaGraphRunner, logits: torch.Tensor, st: object) -> object:
        out = sample(self, logits, st)  # type: ignore[arg-type]
        drawn.append(
            (
                self.last_logits is not None
                and self.last_logits.shape[0] % self.verify_len == 0
                and any(g.logits is self.last_logits for g in self.verify.values()),
                out is not None,
            )
        )
        return out

    monkeypatch.setattr(CudaGraphRunner, "sample", counted)
    engine = Engine(model, None, cfg)
    graphed = engine.generate(PROMPTS, params)
    assert (True, True) in drawn, drawn  # some verify step sampled through its graph
    assert engine.metrics()["rollout/spec_accepted_tokens"] > 0
    monkeypatch.setattr(CudaGraphRunner, "sample", lambda self, logits, st: None)
    eager = Engine(model, None, cfg).generate(PROMPTS, params)
    assert [s.response_ids for s in graphed] == [s.response_ids for s in eager]
    assert [s.rollout_logprobs for s in graphed] == [s.rollout_logprobs for s in eager]


@pytest.mark.parametrize(
    ("moe", "fused", "min_batch"),
    [(False, "auto", 1), (True, "auto", 1), (True, "auto", 16), (False, "off", 4)],
    ids=["qwen3", "qwen3_moe", "qwen3_moe_mixed", "qwen3_unfused"],
)
def test_piecewise_graph_decode_matches_eager(moe: bool, fused: str, min_batch: int) -> None:
    model = gpu_model(moe, seed=2)
    params = GREEDY.with_(n=3)
    eager = Engine(model, None, config(backend="flashinfer", fused_kernels=fused)).generate(PROMPTS, params)
    cfg = config(
        backend="flashinfer",
        cuda_graph=True,
        cuda_graph_piecewise_min_batch=min_batch,
        fused_kernels=fused,
        kv_virtual_memory="off",  # the pool comes back elsewhere: what the graphs must survive by re-capture
    )
    engine = Engine(model, None, cfg)
    graphs = engine.runner.graphs
    assert graphs is not None
    replayed: list[int] = []  # batch sizes of the steps that replayed pieces
    replay_pieces = graphs._replay_pieces

    def counting(batch: object, pieces: object) -> object:
        replayed.append(batch.batch_size)  # type: ignore[attr-defined]
        return replay_pieces(batch, pieces)  # type: ignore[arg-type]

    graphs._replay_pieces = counting  # type: ignore[method-assign]
    pieced = engine.generate(PROMPTS, params)
    assert replayed, "decode never replayed a piecewise graph"
    assert all(graphs._bucket(b) >= min_batch for b in replayed)
    assert all(b >= min_batch for b in graphs.pieces) and all(b < min_batch for b in graphs.graphs)
    assert_agree_until_near_tie(model, eager, pieced, logprob_tol=0.05)
    # The pieces point into the pool too: release and resume re-captures them.
    engine.release_memory()
    engine.resume_memory()
    assert not graphs.pieces
    replayed.clear()
    assert_agree_until_near_tie(model, eager, engine.generate(PROMPTS, params), logprob_tol=0.05)
    assert replayed and graphs.pieces


def test_grouped_gemm_experts_match_the_loop() -> None:
    torch.manual_seed(0)
    experts = Experts(16, 256, 128).cuda()
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    x = torch.randn(300, 256, device="cuda")
    chosen = torch.stack([torch.randperm(16, device="cuda")[:4] for _ in range(300)])
    weights = torch.softmax(torch.randn(300, 4, device="cuda"), -1)
    with torch.no_grad():
        reference = experts(x, chosen, weights)  # float32: the per-expert loop
        grouped = experts.to(torch.bfloat16)(x.bfloat16(), chosen, weights.bfloat16()).float()
    assert float((grouped - reference).norm() / reference.norm()) < 2e-2


def test_expert_dispatch_backward_is_reproducible() -> None:
    """The trainer's gradient through the dispatch is the same bit for bit run to run (a token's k copies
    are not summed with atomics; index_select's backward would: bf16 grads then differ by up to 0.5)."""
    torch.manual_seed(0)
    experts = Experts(64, 512, 256).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    chosen = torch.rand(4096, 64, device="cuda").topk(8, dim=-1).indices
    weights = torch.rand(4096, 8, device="cuda", dtype=torch.bfloat16)
    grads = []
    for _ in range(4):
        xx = x.clone().requires_grad_()
        experts(xx, chosen, weights).float().square().sum().backward()
        grads.append(xx.grad)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_gpu_deterministic_mode_is_batch_invariant() -> None:
    model = gpu_model(moe=True, seed=2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    alone = Engine(model, None, config(deterministic=True)).generate([PROMPTS[1]], params)
    busy = Engine(model, None, config(deterministic=True, max_batch_tokens=7, max_running_requests=7))
    crowded = busy.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], params)[2:4]
    assert [s.rollout_logprobs for s in alone] == [s.rollout_logprobs for s in crowded]


def test_torch_backend_float32_on_cuda_matches_cpu() -> None:
    """The RL loop's GPU path for float32 models (torch attention, shared-prefix decode for n > 1 groups)
    gives the CPU engine's greedy tokens. A non-contiguous CUDA SDPA output once broke it."""
    cpu_model = CausalLM(
        ModelArgs(
            model_type="qwen3_moe",
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        )
    )
    cpu_model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    cuda_model = copy.deepcopy(cpu_model).to("cuda")
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=12)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
    on_cpu = Engine(cpu_model, None, RolloutConfig(backend="torch")).generate(prompts, params)
    on_gpu = Engine(cuda_model, None, RolloutConfig(backend="torch", cuda_graph=False)).generate(
        prompts, params
    )
    assert [s.response_ids for s in on_gpu] == [s.response_ids for s in on_cpu]


def test_overlap_schedule_on_cuda_matches_the_plain_loop() -> None:
    """Overlap scheduling (CUDA's default) with graphs, stop ids and a pool that preempts: the same tokens
    as the loop that reads every step's tokens before planning the next."""
    model = gpu_model(moe=True, seed=4)
    first = Engine(model, None, config(backend="flashinfer")).generate(
        PROMPTS, GREEDY.with_(max_new_tokens=40)
    )
    stops = [first[0].response_ids[6], first[2].response_ids[10]]
    params = GREEDY.with_(n=3, max_new_tokens=40, stop_token_ids=stops)
    outs, dropped = {}, {}
    for mode in ("off", "on"):
        cfg = config(backend="flashinfer", cuda_graph=True, overlap_schedule=mode, page_size=16)
        cfg.kv_cache_fraction = 20.5 * 16 * 3 * 2 * 2 * 128 * 2 / torch.cuda.mem_get_info()[0]
        engine = Engine(model, None, cfg)
        assert engine.overlap == (mode == "on")
        outs[mode] = engine.generate(PROMPTS, params)
        dropped[mode] = engine.stats.dropped_rows
    assert_agree_until_near_tie(model, outs["off"], outs["on"], logprob_tol=0.05, near_tie=0.5)
    assert dropped["off"] == 0 and dropped["on"] > 0, "early stops were meant to run a dropped row"


def test_fused_kernels_match_the_eager_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.models import fused, fused_norm_rope

    torch.manual_seed(0)
    x = torch.randn(37, 8, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(37, 128, device="cuda").bfloat16(), torch.randn(37, 128, device="cuda").bfloat16()
    cases = [
        (fused.rms_norm, (x, w, 1e-6)),
        (fused.rms_norm_rope, (x, w, 1e-6, cos, sin)),
        (fused.qk_norm_rope, (x[:, :6], w, w.flip(0), 4, 1e-6, cos, sin)),
        (fused.add_rms_norm, (x[:, 0], x[:, 1], w, 1e-6)),
        (fused.silu_mul, (x, x.flip(0))),
        (fused.add_slot_sum, (x[:, 0], x[:, :4])),
        (fused.add_slot_sum_rms_norm, (x[:, 0], x[:, :4], w, 1e-6)),
    ]
    for fn, args in cases:
        eager = fn(*args)
        with fused.fused_kernels():
            out = fused.call(fn, *args)
        for e, o in zip(
            eager if isinstance(eager, tuple) else (eager,), out if isinstance(out, tuple) else (out,)
        ):
            assert float((o.float() - e.float()).norm() / e.float().norm()) < 1e-2, fn.__name__
    assert not fused._failed, "torch.compile failed on this GPU; the engine fell back to eager kernels"
    model = gpu_model(moe=True, seed=6)
    eager_out = Engine(model, None, config(backend="flashinfer", fused_kernels="off")).generate(
        PROMPTS, GREEDY
    )
    engine = Engine(model, None, config(backend="flashinfer", cuda_graph=True, fused_kernels="on"))
    assert engine.runner.fused_kernels
    kernel_calls = []
    kernel = fused_norm_rope.qk_norm_rope_kernel
    monkeypatch.setattr(
        fused_norm_rope,
        "qk_norm_rope_kernel",
        # args[7] is v: the call that also writes the KV cache
        lambda *args: kernel_calls.append(len(args) > 7 and args[7] is not None) or kernel(*args),
    )
    assert_agree_until_near_tie(
        model, eager_out, engine.generate(PROMPTS, GREEDY), logprob_tol=0.05, near_tie=0.5
    )
    # The engine's forwards (eager prefill, graph-captured decode) took the q/k Triton kernel, with the KV
    # write folded in, and kept it.
    assert kernel_calls and all(kernel_calls) and fused_norm_rope.kernel.on


@pytest.mark.parametrize(("page_size", "moe"), [(1, False), (16, False), (16, True)])
def test_speculative_decoding_on_cuda_matches_plain_decoding(page_size: int, moe: bool) -> None:
    """n-gram verify steps replayed as CUDA graphs (drafts padded to spec_draft_tokens, flashinfer's decode
    wrapper planned with several query rows per request) give plain decoding's tokens; so do eager verify
    steps (CUDA graphs off: flashinfer's prefill kernel). MoE: the fused router over a verify graph's padded
    rows, and the experts it records for routing replay."""
    model = gpu_model(moe=moe, seed=7)
    params = GREEDY.with_(n=2, max_new_tokens=32, return_routing=moe)
    cfg = config(backend="flashinfer", cuda_graph=True, page_size=page_size, record_routing=moe)
    plain = Engine(model, None, cfg).generate(PROMPTS, params)
    engine = Engine(model, None, replace(cfg, speculative="ngram", spec_draft_tokens=3))
    assert engine.runner.graphs is not None and engine.runner.graphs.verify_len == 4
    replayed = count_verify_graphs(engine)
    spec = engine.generate(PROMPTS, params)
    metrics = engine.metrics()
    # Every verify step replayed a graph: 3 drafts (padded) per request and step, all through one.
    assert replayed and metrics["rollout/spec_draft_tokens"] == 3 * sum(replayed), (replayed, metrics)
    assert metrics["rollout/spec_accepted_tokens"] > 0
    assert_agree_until_near_tie(model, plain, spec, logprob_tol=0.05, near_tie=0.5 if moe else NEAR_TIE)
    for sample in spec if moe else []:
        routed = sample.routed_experts
        assert routed is not None and len(routed) == len(sample.prompt_ids) + len(sample.response_ids) - 1
        assert all(0 <= e < model.args.num_experts for token in routed for layer in token for e in layer)
    eager = Engine(model, None, replace(cfg, cuda_graph=False, speculative="ngram")).generate(PROMPTS, params)
    assert_agree_until_near_tie(model, plain, eager, logprob_tol=0.05, near_tie=0.5 if moe else NEAR_TIE)


def count_replays(graphs: object, method: str) -> list[int]:
    """The batch sizes `graphs.<method>(batch)` replays from now on (a graph runner's replay method)."""
    sizes: list[int] = []
    replay = getattr(graphs, method)

    def counting(batch: object) -> object:
        sizes.append(batch.batch_size)  # type: ignore[attr-defined]
        return replay(batch)

    setattr(graphs, method, counting)
    return sizes


def count_verify_graphs(engine: Engine) -> list[int]:
    """The batch sizes of the verify graphs the engine replays from now on."""
    assert engine.runner.graphs is not None
    return count_replays(engine.runner.graphs, "_replay_verify")


def generate_counting_graphs(
    engine: Engine, params: SamplingParams
) -> tuple[list[Sample], list[int], list[int]]:
    """Samples, and the batch sizes of the verify graphs and of the draft model's decode graphs replayed."""
    assert engine.spec.drafter is not None and engine.spec.drafter.runner.graphs is not None
    verified = count_verify_graphs(engine)
    drafted = count_replays(engine.spec.drafter.runner.graphs, "replay")
    return engine.generate(PROMPTS, params), verified, drafted


@pytest.mark.parametrize("draft_kind", ["copy", "unrelated"])
def test_draft_model_speculation_on_cuda_matches_plain_decoding(draft_kind: str) -> None:
    """A draft model (rollout.speculative=draft) on the GPU: its decode steps replay its own CUDA graphs, the
    engine's verify steps replay the verify graphs, and the tokens are plain decoding's until a near-tie
    (verify and decode kernels round differently in bf16). A copy of the model drafts for itself: nearly
    every draft is accepted, at temperature 1 too (its draws share plain decoding's random numbers)."""
    model = gpu_model(moe=False, seed=7)
    draft = copy.deepcopy(model) if draft_kind == "copy" else gpu_model(moe=False, seed=8)
    cfg = config(backend="flashinfer", cuda_graph=True)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=3)
    for params in (GREEDY.with_(n=2, max_new_tokens=32), sampled):
        plain = Engine(model, None, cfg).generate(PROMPTS, params)
        engine = Engine(
            model, None, replace(cfg, speculative="draft", spec_draft_tokens=3), draft_model=draft
        )
        assert engine.runner.graphs is not None and engine.runner.graphs.verify_len == 4
        spec, verified, drafted = generate_counting_graphs(engine, params)
        metrics = engine.metrics()
        assert verified and drafted, (verified, drafted)
        assert metrics["rollout/spec_draft_tokens"] == 3 * sum(verified), (verified, metrics)
        drafter = engine.spec.drafter
        assert drafter is not None and not drafter.seqs
        assert drafter.pool.free_tokens == drafter.pool.capacity_tokens
        if draft_kind == "copy":
            assert metrics["rollout/spec_accepted_tokens"] > 0.8 * metrics["rollout/spec_draft_tokens"], (
                metrics
            )
        if params.temperature > 0:  # plain draws on the draft's decode graphs replay its sampler graphs
            assert drafter.graphed_draws > 0, (drafter.graphed_draws, drafter.draws)
        else:
            assert drafter.graphed_draws == 0 < drafter.draws
        if params.temperature == 0.0:
            assert_agree_until_near_tie(model, plain, spec, logprob_tol=0.05)
        else:  # the same draws: tokens agree unless bf16 rounding moves a draw across a token boundary
            same = sum(a.response_ids == b.response_ids for a, b in zip(plain, spec))
            assert same >= len(plain) // 2, [(a.response_ids, b.response_ids) for a, b in zip(plain, spec)]


def test_draft_head_speculation_on_cuda_matches_plain_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft head (rollout.speculative=head) on the GPU, trained there on the model's own samples (bf16 head
    with float32 masters, flash varlen attention for the policy's hidden states): verify steps replay the
    verify graphs, whose hidden-state buffers the head starts from, greedy drafts are accepted, and the tokens
    are plain decoding's until a near-tie. Proposals chained behind the verify steps are the ones the next
    step would make."""
    from miles.models.draft_head import new_draft_head
    from miles.trainer.draft.head_trainer import DraftHeadTrainer
    from tests.rollout.test_draft_head import compare_chained_proposals

    model = gpu_model(moe=False, seed=7)
    cfg = config(backend="flashinfer", cuda_graph=True)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=3)
    for params in (GREEDY.with_(n=2, max_new_tokens=32), sampled):
        plain = Engine(model, None, cfg).generate(PROMPTS, params)
        head = new_draft_head(model.args, 0, model.dtype, model.device, seed=1)
        spec_cfg = replace(cfg, speculative="head", spec_draft_tokens=3, spec_draft_train=True)
        trainer = DraftHeadTrainer(
            head, model, TrainerConfig(), replace(spec_cfg, spec_draft_lr=3e-3, spec_draft_train_epochs=40)
        )
        assert trainer.masters is not None
        metrics = trainer.train_step(plain)
        assert metrics["draft/loss_last_epoch"] < 0.5 * metrics["draft/loss"], metrics
        engine = Engine(model, None, spec_cfg, draft_head=head.eval())
        assert engine.runner.graphs is not None and engine.runner.graphs.verify_len == 4
        verified = count_verify_graphs(engine)
        compared = compare_chained_proposals(monkeypatch, whole_steps_only=True)
        spec = engine.generate(PROMPTS, params)
        m = engine.metrics()
        assert verified, m
        assert sum(compared) == m["rollout/spec_chained_drafts"] > 0, m
        # Proposals replay the proposal graphs (draft_head_graph.py), greedy and temperature-1 ones alike.
        assert engine.spec.head_drafter is not None and engine.spec.head_drafter.graphs is not None
        assert engine.spec.head_drafter.graphs.replays > 0, m
        if (
            params.temperature == 0.0
        ):  # (a random bf16 model's flat distributions rarely agree at temperature 1)
            assert m["rollout/spec_accepted_tokens"] > 0.1 * m["rollout/spec_proposed_tokens"], m
            assert_agree_until_near_tie(model, plain, spec, logprob_tol=0.05)
        else:
            same = sum(a.response_ids == b.response_ids for a, b in zip(plain, spec))
            assert same >= len(plain) // 2, [(a.response_ids, b.response_ids) for a, b in zip(plain, spec)]


def test_a_gated_head_on_cuda_decodes_overlapped_plain_steps_between_probes() -> None:
    """rollout.spec_min_accept_length on the GPU: a new head keeps fewer than 3.9 of 4 tokens a step, so decode
    steps run plain with overlap scheduling (CUDA graphs) and verify graphs replay only on probes; the tokens
    are plain decoding's until a near-tie."""
    model = gpu_model(moe=False, seed=7)
    cfg = config(backend="flashinfer", cuda_graph=True)
    params = GREEDY.with_(n=2, max_new_tokens=48)
    plain = Engine(model, None, cfg).generate(PROMPTS, params)
    gated = replace(
        cfg, speculative="head", spec_draft_tokens=3, spec_min_accept_length=3.9, spec_probe_every=4
    )
    engine = Engine(model, None, gated)
    assert engine.overlap
    verified = count_verify_graphs(engine)
    spec = engine.generate(PROMPTS, params)
    decode_steps, m = engine.stats.decode_steps, engine.metrics()
    assert verified and m["rollout/spec_steps"] > 0, m
    assert m["rollout/spec_gated_steps"] > decode_steps / 2, (decode_steps, m)
    assert_agree_until_near_tie(model, plain, spec, logprob_tol=0.05)


def test_draft_head_proposal_graphs_draw_the_eager_proposals() -> None:
    """A proposal replayed as a CUDA graph (draft_head_graph.py) is the eager proposal bit for bit at a
    bucket's own size; padded to a bucket, its rows are those the eager proposal gives the same requests
    beside others (rows do not mix); all-greedy proposals have graphs of their own; filtered draws, greedy
    rows mixed with sampled ones, and batches past the buckets run eagerly."""
    from miles.models.draft_head import new_draft_head
    from miles.rollout.request import Request
    from miles.rollout.spec.head import DraftHeadProposer
    from miles.rollout.spec.head_graph import HeadProposalGraphs

    model = gpu_model(moe=False, seed=3)
    head = new_draft_head(model.args, 0, model.dtype, model.device, seed=2)
    with torch.no_grad():  # a head whose MLP counts (a new one's output projection is zero)
        head.mlp.down_proj.weight.normal_(std=0.02)
    graphs = HeadProposalGraphs(head, model, 3, [1, 2, 4, 8])
    eager, graphed = DraftHeadProposer(head, model, True), DraftHeadProposer(head, model, True, graphs)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, model.args.hidden_size, generator=generator).to(model.device, model.dtype)

    def requests(temperatures: list[float], **params: float) -> list[Request]:
        return [
            Request(
                i, [1, 2], SamplingParams(temperature=t, **params), seed=40 + i, output_ids=[5 + i] * (1 + i)
            )
            for i, t in enumerate(temperatures)
        ]

    reqs, rows, ks = requests([1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 2.0, 1.0]), [3, 0, 11, 5, 5, 7, 1, 9], [3] * 8
    want = eager.propose(reqs, ks, hidden, rows)
    assert graphs.replays == 0
    assert graphed.propose(reqs, ks, hidden, rows) == want and graphs.replays == 1
    assert len({tuple(d) for d in want}) > 4  # the draws differ between requests
    graphed.propose(reqs[::-1], ks, hidden, rows[::-1])  # other inputs left in the padding rows below
    assert graphed.propose(reqs[:5], [3, 1, 2, 3, 0], hidden, rows[:5]) == [
        d[:k] for d, k in zip(want[:5], [3, 1, 2, 3, 0])
    ]
    assert graphs.replays == 3
    greedy = requests([0.0, 0.0])  # all greedy: a graph of its own
    assert graphed.propose(greedy, [3, 3], hidden, rows[:2]) == eager.propose(
        greedy, [3, 3], hidden, rows[:2]
    )
    assert graphs.replays == 4
    # Filtered draws, greedy rows beside sampled ones, more requests than the buckets: eager.
    for others in (requests([1.0] * 3, top_k=20), requests([0.0, 1.0, 1.0]), requests([1.0] * 9)):
        ks, picked = [3] * len(others), list(range(len(others)))
        assert graphed.propose(others, ks, hidden, picked) == eager.propose(others, ks, hidden, picked)
    assert graphs.replays == 4


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(1, 16, 4, 256, 128), (300, 16, 4, 256, 128), (523, 128, 8, 2048, 768), (37, 60, 4, 320, 96)],
)
def test_fused_moe_matches_the_grouped_experts(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> None:
    """The Triton experts against a float32 per-expert loop: no further from it than the grouped GEMMs
    (300 tokens over 16 experts puts several row blocks on one expert; 60 experts and widths that are not
    multiples of the tiles exercise the masks)."""
    from miles.models import fused_moe

    torch.manual_seed(tokens)
    layer = Experts(experts, hidden, inter).cuda()
    torch.nn.init.normal_(layer.gate_up_proj, std=hidden**-0.5)
    torch.nn.init.normal_(layer.down_proj, std=inter**-0.5)
    x = torch.randn(tokens, hidden, device="cuda")
    chosen = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda"), -1)
    with torch.no_grad():
        reference = layer(x, chosen, weights)
        bf = layer.to(torch.bfloat16)
        grouped = bf(x.bfloat16(), chosen, weights.bfloat16()).float()
        fused_out = fused_moe.experts_forward(
            x.bfloat16(), bf.gate_up_proj, bf.down_proj, chosen, weights.bfloat16()
        ).float()

    def err(out: torch.Tensor) -> float:
        return float((out - reference).norm() / reference.norm())

    assert err(fused_out) < 1.25 * err(grouped) + 1e-3, (err(fused_out), err(grouped))
    assert float((fused_out - grouped).norm() / grouped.norm()) < 1e-2


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize"), [(1, 8, 2, True), (523, 128, 8, True), (37, 60, 4, False)]
)
def test_fused_router_matches_softmax_topk(tokens: int, experts: int, top_k: int, renormalize: bool) -> None:
    """One kernel for softmax, top-k and renormalisation picks what torch.topk picks (highest first) with
    weights equal to bf16 rounding."""
    import torch.nn.functional as F

    from miles.models import fused_moe

    torch.manual_seed(tokens)
    logits = (torch.randn(tokens, experts, device="cuda") * 3).bfloat16()
    weights, chosen = fused_moe.route(logits, top_k, renormalize, torch.bfloat16)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    ref_w, ref_c = torch.topk(probs, top_k, dim=-1)
    ref_w_raw = ref_w
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    # bf16 logits tie often; among equal probabilities either expert is a right pick.
    assert (chosen.sort(-1).values.diff(dim=-1) > 0).all(), "an expert picked twice"
    torch.testing.assert_close(probs.gather(-1, chosen), ref_w_raw, rtol=1e-6, atol=0)
    torch.testing.assert_close(weights, ref_w.bfloat16(), atol=0, rtol=8e-3)


def test_fused_router_keeps_nan_rows_in_range() -> None:
    """A NaN/inf row of router logits (a diverged policy) yields valid, distinct expert ids (their weights
    stay NaN, as eager's do), so routing replay and the expert layout never see an id out of range."""
    from miles.models import fused_moe

    logits = torch.randn(6, 60, device="cuda").bfloat16()
    logits[1, 7], logits[4, 2] = float("nan"), float("inf")
    weights, chosen = fused_moe.route(logits, 4, True, torch.bfloat16)
    assert ((chosen >= 0) & (chosen < 60)).all()
    assert (chosen.sort(-1).values.diff(dim=-1) > 0).all()
    assert weights[[1, 4]].isnan().all() and not weights[[0, 2, 3, 5]].isnan().any()


@pytest.mark.parametrize(("tokens", "hq", "hk", "dim"), [(523, 32, 4, 128), (37, 16, 8, 64), (1, 6, 2, 128)])
def test_qk_norm_rope_kernel_matches_the_eager_functions(tokens: int, hq: int, hk: int, dim: int) -> None:
    """The Triton q/k norm+RoPE on a strided view of the QKV output (as the attention layer passes it) against
    the eager functions: the roundings are eager's, so only the float32 sum order of the norm differs (one
    rounding step, on a few elements)."""
    dtype = torch.bfloat16
    from miles.models import fused, fused_norm_rope

    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, device="cuda", dtype=dtype) * 3
    qk = qkv[:, : (hq + hk) * dim].view(tokens, hq + hk, dim)
    wq, wk = torch.randn(dim, device="cuda", dtype=dtype), torch.randn(dim, device="cuda", dtype=dtype)
    angle = torch.rand(tokens, dim, device="cuda") * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    with torch.no_grad(), fused.fused_kernels():
        assert fused_norm_rope.applies(qk, wq, wk, cos, sin)
        got = fused_norm_rope.qk_norm_rope_kernel(qk, wq, wk, hq, 1e-6, cos, sin)
    ref = fused.qk_norm_rope(qk, wq, wk, hq, 1e-6, cos, sin)
    diff = (got.float() - ref.float()).abs()
    # One rounding step of a RoPE term, relative to the head's largest value (the sum may cancel).
    assert (diff <= 4 * 2.0**-7 * ref.float().abs().amax(-1, keepdim=True)).all(), float(diff.max())
    # A cast to bf16 and back instead of the bit rounding differed on ~16 % of the elements.
    assert float((diff > 0).float().mean()) < 1e-3


@pytest.mark.parametrize(("tokens", "hq", "hk", "dim", "page"), [(523, 32, 4, 128, 16), (7, 6, 3, 64, 1)])
def test_qk_norm_rope_kernel_writes_k_and_v_to_their_cache_slots(
    tokens: int, hq: int, hk: int, dim: int, page: int
) -> None:
    """With the KV write folded in: q/k out as without it, and at each token's slot of the paged caches its
    rotated k and its v (bit for bit what `KVPool.write` stores); every other slot untouched."""
    dtype = torch.bfloat16
    from miles.models import fused, fused_norm_rope
    from miles.models.attention import KVWrite

    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, device="cuda", dtype=dtype) * 3
    qk = qkv[:, : (hq + hk) * dim].view(tokens, hq + hk, dim)
    v = qkv[:, (hq + hk) * dim :].view(tokens, hk, dim)
    wq, wk = torch.randn(dim, device="cuda", dtype=dtype), torch.randn(dim, device="cuda", dtype=dtype)
    angle = torch.rand(tokens, dim, device="cuda") * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    num_pages = tokens // page + 8
    k_cache = torch.full((num_pages, page, hk, dim), 7.0, device="cuda", dtype=dtype)
    v_cache = torch.full_like(k_cache, 7.0)
    slots = torch.randperm(num_pages * page - page, device="cuda")[:tokens] + page  # page 0 stays free
    with torch.no_grad(), fused.fused_kernels():
        got = fused_norm_rope.qk_norm_rope_into_cache(
            qk, v, wq, wk, hq, 1e-6, cos, sin, KVWrite(k_cache, v_cache, slots)
        )
        plain = fused_norm_rope.qk_norm_rope_kernel(qk, wq, wk, hq, 1e-6, cos, sin)
    assert got is not None and torch.equal(got, plain)
    # Into a given output buffer (piecewise graphs): the same values, in that buffer.
    buffer = torch.full((tokens, hq + hk, dim), 5.0, device="cuda", dtype=dtype)
    with torch.no_grad(), fused.fused_kernels():
        into = fused_norm_rope.qk_norm_rope_into_cache(
            qk, v, wq, wk, hq, 1e-6, cos, sin, KVWrite(k_cache, v_cache, slots, out=buffer)
        )
    assert into is not None and into.data_ptr() == buffer.data_ptr() and torch.equal(buffer, plain)
    flat_k, flat_v = k_cache.view(-1, hk, dim), v_cache.view(-1, hk, dim)
    assert torch.equal(flat_k[slots], plain[:, hq:]) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(num_pages * page, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert (flat_k[untouched] == 7.0).all() and (flat_v[untouched] == 7.0).all()
    # A layout the kernel cannot write (float32 caches) declines, so the caller writes through `attend`.
    with torch.no_grad(), fused.fused_kernels():
        wide = KVWrite(k_cache.float(), v_cache.float(), slots)
        assert fused_norm_rope.qk_norm_rope_into_cache(qk, v, wq, wk, hq, 1e-6, cos, sin, wide) is None


def test_bf16_bit_rounding_matches_torch_on_special_values() -> None:
    """The q/k kernel's rounding helper against torch's bf16 cast: ties, inf, NaN, overflow, subnormals."""
    torch.manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int64).to(torch.int32)
    exact = torch.randn(4096).bfloat16().float()
    ties = (exact.view(torch.int32) + 0x8000).view(torch.float32)  # halfway between two bf16 values
    special = torch.tensor(
        [float("inf"), -float("inf"), float("nan"), 3.3895314e38, -3.3895314e38, 0.0, -0.0, 1e-40]
    )
    x = torch.cat([bits.view(torch.float32), ties, special]).cuda()
    out = torch.empty_like(x)
    _round_bf16_all[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    ref = x.bfloat16().float()
    assert bool(((out == ref) | (out.isnan() & ref.isnan())).all())


def test_fused_moe_skips_padding_rows() -> None:
    """Rows from `valid_rows` on (CUDA-graph padding) get expert id E and weight 0, and the experts compute
    nothing for them; the real rows come out exactly as without the padding."""
    from miles.models import fused_moe

    torch.manual_seed(3)
    tokens, real, experts, top_k, hidden, inter = 40, 29, 16, 4, 256, 128
    layer = Experts(experts, hidden, inter).cuda().bfloat16()
    torch.nn.init.normal_(layer.gate_up_proj, std=hidden**-0.5)
    torch.nn.init.normal_(layer.down_proj, std=inter**-0.5)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    logits = torch.randn(tokens, experts, device="cuda").bfloat16()
    valid = torch.tensor([real], dtype=torch.int32, device="cuda")
    weights, chosen = fused_moe.route(logits, top_k, True, torch.bfloat16, valid_rows=valid)
    full_w, full_c = fused_moe.route(logits, top_k, True, torch.bfloat16)
    assert torch.equal(chosen[:real], full_c[:real]) and torch.equal(weights[:real], full_w[:real])
    assert (chosen[real:] == experts).all() and (weights[real:] == 0).all()
    layout = fused_moe.align(chosen, experts, 16)
    rows = layout.sorted_pairs[: int(layout.total)]
    assert int((rows < chosen.numel()).sum()) == real * top_k  # padding pairs are left out
    cfg = fused_moe.TileConfig(16, 64, 64, 4, 3)
    with torch.no_grad():
        padded = fused_moe.experts_forward(x, layer.gate_up_proj, layer.down_proj, chosen, weights, cfg, cfg)
        alone = fused_moe.experts_forward(
            x[:real], layer.gate_up_proj, layer.down_proj, full_c[:real], full_w[:real], cfg, cfg
        )
    assert torch.equal(padded[:real], alone)


def test_compiled_sampler_draws_what_the_eager_one_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's unfiltered draw on CUDA with fused kernels (compiled block totals) against the eager
    float64 inverse CDF: same tokens, logprobs to float32 rounding; mixed greedy rows included."""
    from miles.models import fused
    from miles.rollout.sampling import triton_kernel
    from miles.rollout.sampling.sampler import SamplingTensors, sample, uniforms

    torch.manual_seed(0)
    rows, vocab = 300, 151936
    logits = (torch.randn(rows, vocab, device="cuda") * 4).bfloat16()
    temps = [0.0 if i % 7 == 0 else (1.0 if i % 2 else 0.8) for i in range(rows)]
    params = SamplingTensors.build(
        temps,
        [0] * rows,
        [1.0] * rows,
        [0.0] * rows,
        uniforms(list(range(rows)), [5] * rows),
        vocab,
        torch.device("cuda"),
    )
    eager = sample(logits, params)
    kernel_calls = []
    kernel = triton_kernel.block_masses_kernel
    monkeypatch.setattr(
        triton_kernel, "block_masses_kernel", lambda *args: kernel_calls.append(1) or kernel(*args)
    )
    with fused.fused_kernels():
        compiled = sample(logits, params)
    assert kernel_calls and triton_kernel.kernel.on and not fused._failed  # totals from the kernel
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampler_block_kernel_matches_the_eager_totals(dtype: torch.dtype) -> None:
    """The one-pass Triton block totals against eager `block_masses` (float64 sums of exp(scaled - max)): the
    same maximum bit for bit, totals within float32 rounding; blocks of -inf logits count 0, a partial last
    block, a strided (sliced) logits tensor and a low temperature (blocks far below the maximum) included."""
    from miles.rollout.sampling import triton_kernel
    from miles.rollout.sampling.sampler import _CDF_BLOCK, block_masses

    torch.manual_seed(0)
    rows, vocab = 37, 151936
    wide = (torch.randn(rows, vocab + 64, device="cuda") * 4).to(dtype)
    logits = wide[:, :vocab]  # row stride vocab + 64
    logits[3, : 5 * _CDF_BLOCK] = float("-inf")
    logits[4, 77] = 40.0  # one dominant token: the other blocks' totals underflow towards 0
    temperature = torch.rand(rows, device="cuda") + 0.5
    temperature[5] = 0.05  # scaled logits span about +-300: most of the row's block totals underflow to 0
    top, mass = triton_kernel.block_masses_kernel(logits, temperature, _CDF_BLOCK)
    ref_top, ref_mass = block_masses(logits, temperature)
    assert torch.equal(top, ref_top)
    assert mass.dtype == torch.float64 and mass.shape == ref_mass.shape
    assert torch.equal(mass[3, :5], torch.zeros(5, dtype=torch.float64, device="cuda"))
    # A block is empty exactly where eager's is (its largest weight, exp(m_b - max) in float32, underflows in
    # both), so the draw never lands in a block whose recomputed weights are all 0.
    assert torch.equal(mass == 0, ref_mass == 0)
    # Each block's share of its row. Far below the maximum the float32 rounding of `scaled - max`
    # (~|scaled - max| * 2^-24 relative) dominates, and subnormal weights keep fewer bits: what the draw sees
    # is the share, which such blocks change by far less than 1e-6.
    share, ref_share = mass / mass.sum(-1, keepdim=True), ref_mass / ref_mass.sum(-1, keepdim=True)
    torch.testing.assert_close(share, ref_share, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block"), [(97, 12, 3, 16), (1100, 128, 8, 64)])
def test_fused_moe_layout_groups_pairs_by_expert(tokens: int, experts: int, top_k: int, block: int) -> None:
    """Each row block holds one expert's pairs in pair order, padding rows are marked, and every pair
    appears exactly once: with all pairs in one chunk of the align kernel, and (8,800 pairs) over several."""
    from miles.models import fused_moe

    torch.manual_seed(0)
    chosen = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    chosen[: tokens * 2 // 5, 0] = 5  # one expert well over a block
    layout = fused_moe.align(chosen, experts, block)
    pairs = chosen.numel()
    total = int(layout.total)
    rows = layout.sorted_pairs[:total].cpu()
    blocks = layout.block_expert[: total // block].cpu()
    flat = chosen.reshape(-1).cpu()
    real = rows[rows < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    counts = torch.bincount(flat, minlength=experts)
    assert total == int(((counts + block - 1) // block * block).sum())
    for b, expert in enumerate(blocks.tolist()):
        rows_of_block = rows[block * b : block * (b + 1)]
        rows_of_block = rows_of_block[rows_of_block < pairs]
        assert (flat[rows_of_block] == expert).all()
        assert torch.equal(rows_of_block, rows_of_block.sort().values)
    assert blocks.tolist() == sorted(blocks.tolist())


def test_engine_moe_decode_runs_the_fused_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fused kernels on, the engine's MoE forwards (graphed decode included) take the Triton experts,
    and the outputs agree with the grouped-GEMM engine."""
    from miles.models import fused_moe

    calls = []
    original = fused_moe.experts_forward

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    model = gpu_model(moe=True, seed=8)
    grouped_out = Engine(model, None, config(backend="flashinfer", fused_kernels="off")).generate(
        PROMPTS, GREEDY
    )
    assert not calls
    monkeypatch.setattr(fused_moe, "experts_forward", counted)
    engine = Engine(
        model, None, config(backend="flashinfer", cuda_graph=True, fused_kernels="on", record_routing=True)
    )
    # Graph padding rows skip the experts and may write NaN to page 0; no real request may read it.
    engine.pool.k_cache[:, 0] = float("nan")  # type: ignore[index]
    engine.pool.v_cache[:, 0] = float("nan")  # type: ignore[index]
    fused_out = engine.generate(PROMPTS, GREEDY)  # 5 requests: graph bucket 8, so 3 padding rows
    assert calls and fused_moe.available()
    assert_agree_until_near_tie(model, grouped_out, fused_out, logprob_tol=0.05, near_tie=0.5)
    # The fused router still records each token's experts for routing replay (3 requests: 1 padding row).
    routed = engine.generate(PROMPTS[:3], GREEDY.with_(return_routing=True, max_new_tokens=8))
    for sample in routed:
        assert sample.routed_experts is not None and len(sample.routed_experts) == len(sample.prompt_ids) + 7
        assert all(
            len(layer) == model.args.num_experts_per_tok for token in sample.routed_experts for layer in token
        )
        # Graph padding rows route to id E; none of that reaches a sample.
        assert all(
            0 <= e < model.args.num_experts
            for token in sample.routed_experts
            for layer in token
            for e in layer
        )


def test_padding_rows_get_an_expert_when_the_fused_experts_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the Triton experts fail after the fused router gave padding rows id E, the grouped experts run
    with those rows clamped to a real expert; the real rows come out as the eager block's."""
    from miles.models import fused, fused_moe
    from miles.models.moe import RoutingTrace, SparseMoeBlock

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("no Triton experts here")

    block = gpu_model(moe=True, seed=8).model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = torch.randn(12, block.gate.in_features, device="cuda", dtype=torch.bfloat16)
    real = 9
    with torch.no_grad():
        reference = block(x[:real], RoutingTrace())  # eager router, grouped experts
    with torch.no_grad(), fused.fused_kernels():
        monkeypatch.setattr(fused_moe, "experts_forward", broken)
        monkeypatch.setattr(fused_moe.kernels, "on", True)
        trace = RoutingTrace(valid_rows=torch.tensor([real], dtype=torch.int32, device="cuda"))
        out = block(x, trace)
    assert not fused_moe.kernels.on, "the failure turned the fused kernels off"
    assert (trace.recorded[0][real:] == block.num_experts).all()
    torch.testing.assert_close(out[:real], reference)  # bf16 tolerance: the routers' exp may round apart


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize(("tokens", "experts", "hidden", "inter"), [(523, 128, 2048, 768), (37, 60, 320, 96)])
def test_fused_moe_tile_variants_agree(tokens: int, experts: int, hidden: int, inter: int, tma: bool) -> None:
    """Column blocks wider than the layer (320 / 96 wide), 256-wide tiles and TMA weight loads compute what
    the default tiles compute: TMA only changes how the weight tiles reach shared memory, so its result
    should equal the pointer loads' of the same tile (both accumulate over K in the same order)."""
    from miles.models import fused_moe

    torch.manual_seed(tokens)
    layer = Experts(experts, hidden, inter).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(layer.gate_up_proj, std=hidden**-0.5)
    torch.nn.init.normal_(layer.down_proj, std=inter**-0.5)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    chosen = torch.rand(tokens, experts, device="cuda").topk(8, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, 8, device="cuda"), -1).bfloat16()

    def run(up: fused_moe.TileConfig, down: fused_moe.TileConfig) -> torch.Tensor:
        with torch.no_grad():
            return fused_moe.experts_forward(
                x, layer.gate_up_proj, layer.down_proj, chosen, weights, up, down
            )

    reference = run(fused_moe.TileConfig(32, 64, 64, 4, 3), fused_moe.TileConfig(32, 64, 64, 4, 3))
    for bn, bk, warps in [(64, 64, 4), (128, 128, 8), (256, 64, 8)]:
        cfg = fused_moe.TileConfig(32, bn, bk, warps, 3, tma)
        out = run(cfg, cfg)
        assert float((out.float() - reference.float()).norm() / reference.float().norm()) < 1e-2, cfg
        if tma:
            assert torch.equal(out, run(replace(cfg, tma=False), replace(cfg, tma=False))), cfg


def test_the_kv_pool_leaves_the_reserved_memory_free() -> None:
    """`reserve_bytes` (a colocated trainer's optimizer state and gradients to come) is left out of the free
    memory the pool takes its fraction of; a released pool comes back as large."""
    import gc

    model = gpu_model(False)
    cfg = config(backend="torch", kv_cache_fraction=0.1)
    reserve = 16 << 30
    sizes = []
    for reserved in (0, reserve):
        gc.collect()  # earlier tests' engines, freed late, would change the free memory between the two
        torch.cuda.empty_cache()
        engine = Engine(model, None, cfg, reserve_bytes=reserved)
        sizes.append(engine.pool.nbytes)
        engine.release_memory()
        engine.resume_memory()
        assert engine.pool.nbytes == sizes[-1]
        assert len(engine.generate(PROMPTS[:2], GREEDY)) == 2
        del engine
    assert sizes[0] - sizes[1] == pytest.approx(0.1 * reserve, rel=0.02)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe_routing"])
def test_a_released_kv_pool_comes_back_at_its_addresses_and_the_graphs_replay(
    moe: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kv_virtual_memory: a release gives the pool's memory back to the device, the resume maps new memory at
    the same addresses (zeroed), and the captured graphs, whole and in pieces, replay without a new capture
    to the same tokens, logprobs and routing as before the release, also for requests released mid-decode."""
    import gc

    captures = count_graph_captures(monkeypatch)
    model = gpu_model(moe, seed=9)
    params = GREEDY.with_(n=3, return_routing=moe)
    cfg = config(backend="flashinfer", cuda_graph=True, cuda_graph_piecewise_min_batch=8, record_routing=moe)
    assert not Engine(model, None, cfg).pool.keeps_addresses, (
        "auto without a release must leave torch the pool"
    )
    engine = Engine(model, None, replace(cfg, release_kv_during_train=True))  # auto: kept addresses
    pool = engine.pool
    assert pool.region is not None and pool.bytes_outside_allocator >= pool.nbytes
    assert pool.k_cache is not None and pool.k_cache.data_ptr() == pool.region.address
    before = engine.generate(PROMPTS, params)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.graphs and graphs.pieces and captures == [1]
    kept = {**graphs.graphs, **graphs.pieces}
    tensors = [t for t in (pool.k_cache, pool.v_cache, pool.routing) if t is not None]
    addresses = [t.data_ptr() for t in tensors]

    def free_memory() -> int:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    held = free_memory()
    engine.release_memory()
    released = free_memory()
    assert not pool.region.mapped and pool.bytes_outside_allocator == 0
    assert released - held >= 0.99 * pool.nbytes, "the release freed no memory"
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS[:1], GREEDY)
    junk = torch.full((pool.nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")  # reuse bait
    del junk
    engine.resume_memory()
    assert released - free_memory() >= 0.99 * pool.nbytes, "the resume took no memory"
    assert [t.data_ptr() for t in tensors] == addresses
    assert all(int(t.count_nonzero()) == 0 for t in tensors), "a resumed pool holds old memory's contents"
    after = engine.generate(PROMPTS, params)
    # Released mid-decode (the overlap step in flight): retracted, recomputed on the kept graphs.
    rids = [engine.add_request(p, GREEDY.with_(return_routing=moe)) for p in PROMPTS]
    for _ in range(5):
        engine.step()
    engine.release_memory()
    engine.resume_memory()
    while engine.has_unfinished:
        engine.step()
    interrupted = [engine.take_result(rid) for rid in rids]
    assert captures == [1], "the graphs were captured again"
    assert all(kept[b] is g for b, g in {**graphs.graphs, **graphs.pieces}.items() if b in kept)
    single = engine.generate(PROMPTS, GREEDY.with_(return_routing=moe))  # the same requests, uninterrupted
    assert all(s is not None for s in interrupted)
    # The retracted requests recompute their tokens through prefill kernels (MoE: the grouped experts, not
    # the fused decode ones), so they agree with the uninterrupted run to the mixed-kernel tolerance.
    assert_agree_until_near_tie(model, single, interrupted, logprob_tol=0.25)  # type: ignore[arg-type]
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
    assert [s.rollout_logprobs for s in after] == [s.rollout_logprobs for s in before]
    if moe:
        assert [s.routed_experts.tolist() for s in after] == [s.routed_experts.tolist() for s in before]


def test_alternatives_on_cuda_come_back_with_their_tokens() -> None:
    """`top_logprobs` on the GPU (CUDA-graph decode, overlap scheduling): the alternatives travel back with
    the step's tokens; a greedy token is its own first alternative, with its logprob, and the samples are
    those drawn without alternatives."""
    model = gpu_model(moe=False, seed=7)
    cfg = config(backend="flashinfer", cuda_graph=True)
    for params in (
        GREEDY.with_(n=2),
        SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=24, seed=3),
    ):
        plain = Engine(model, None, cfg).generate(PROMPTS, params)
        got = Engine(model, None, cfg).generate(PROMPTS, params.with_(top_logprobs=3))
        assert [s.response_ids for s in got] == [s.response_ids for s in plain]
        for s in got:
            assert s.top_logprobs is not None and len(s.top_logprobs) == len(s.response_ids)
            assert all(1 <= len(alts) <= 3 for alts in s.top_logprobs)
            for token, logprob, alts in zip(s.response_ids, s.rollout_logprobs, s.top_logprobs):
                values = [v for _, v in alts]
                assert values == sorted(values, reverse=True)
                if params.temperature == 0.0:
                    assert alts[0][1] == pytest.approx(
                        logprob, abs=1e-3
                    )  # (an exact tie may order either way)
                    assert token in [t for t, v in alts if v == alts[0][1]]
