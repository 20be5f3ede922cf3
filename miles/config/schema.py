"""Typed Hydra structured configs: one dataclass per config group, composed into `MilesConfig`.

Every field is validated by OmegaConf when a recipe or an override is merged, so a typo fails at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class ModelConfig:
    path: str = MISSING
    """HF-format checkpoint folder (config.json + safetensors + tokenizer); `builtin:NAME` names a shipped one."""
    dtype: str = "float32"
    """Parameter dtype for trainer and engine: float32 | bfloat16 | float16 | auto (bfloat16 on a GPU that
    has it, float32 on CPU)."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cpu | cuda | cuda:N."""
    chat_template: bool = True
    """Format prompts with the tokenizer's chat template when it has one."""


@dataclass
class DataConfig:
    source: str = "synthetic_math"
    """synthetic_math | file (jsonl/parquet/saved dataset at `path`) | reasoning_gym:<task>."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """reasoning_gym:<task> only: the task's own generator settings, e.g. {min_terms: 3, max_digits: 2} for
    chain_sum (reasoning-gym's `<Task>Config` fields)."""
    path: str | None = None
    """Local jsonl / parquet file or saved `datasets` folder (source=file; setting it implies file)."""
    eval_path: str | None = None
    """Held-out rows for eval (jsonl / parquet / saved dataset[:split]), whatever the training source; None:
    the synthetic / reasoning-gym test split, or nothing for source=file."""
    prompt_key: str = "prompt"
    """Column holding the prompt (text or chat messages)."""
    label_key: str = "label"
    """Column holding the ground truth; verl's `reward_model.ground_truth` is read automatically."""
    prompt_template: str | None = None
    """Python format string with `{prompt}` used instead of the chat template (e.g. '{prompt}\\n')."""
    system_prompt: str | None = None
    """System message prepended when the chat template is used."""
    fewshot: list[dict[str, str]] = field(default_factory=list)
    """Worked examples shown before each prompt as earlier chat turns, after the system message:
    [{user: "7 - 2 + 5 =", assistant: "7 - 2 = 5\n5 + 5 = 10\n#### 10"}, ...]. Chat template only."""
    max_prompt_length: int = 256
    """Prompts longer than this (tokens) are dropped with a counted warning."""
    train_size: int = 20000
    """Number of synthetic / reasoning-gym training problems."""
    test_size: int = 200
    """Number of held-out problems."""
    seed: int = 0
    """Seed for synthetic data generation and shuffling."""
    difficulty: str = "easy"
    """Synthetic math difficulty: easy | medium."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    sft_noise: float = 0.0
    """Synthetic math, SFT only: fraction of reference solutions that pick the wrong operation (noisy demos)."""


@dataclass
class RolloutConfig:
    backend: str = "auto"
    """Attention backend: auto | torch | flashinfer."""
    rollout_batch_size: int = 16
    """Prompts per RL step."""
    n_samples_per_prompt: int = 8
    """Responses generated per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables."""
    min_p: float = 0.0
    """Drop tokens below min_p times the top probability; 0 disables."""
    max_new_tokens: int = 32
    """Response length cap."""
    stop: list[str] = field(default_factory=list)
    """Stop strings."""
    max_batch_tokens: int = 4096
    """Token budget of one engine step (prefill chunks + decodes)."""
    max_running_requests: int = 256
    """Most requests decoding at once."""
    max_context: int | None = None
    """Longest prompt + response (None: the model's context, YaRN's factor included); a lower value keeps the
    request table smaller."""
    kv_cache_bytes: int = 256 * 1024 * 1024
    """KV pool size on CPU (bytes)."""
    kv_cache_fraction: float = 0.5
    """KV pool size on GPU as a fraction of the memory free after the weights, less what the colocated
    trainer will allocate at its first update (optimizer moments and gradients)."""
    release_kv_during_train: bool = False
    """GPU: free the KV pool while the trainer updates, so the update's activations can use that memory
    (allocated again, empty, for the next rollout)."""
    release_weights_during_train: bool = False
    """GPU, embedded placement, an engine with weights of its own (trainer.backend=megatron or deepspeed):
    free the engine's copy of the weights while the trainer updates, and map it again, at the same addresses
    (the decode CUDA graphs stay), for the weight sync to rewrite after the update. Outside torch's allocator
    (CUDA virtual memory), like a kept-address KV pool."""
    kv_virtual_memory: str = "auto"
    """GPU: the KV pool in a reserved range of CUDA virtual addresses, so that releasing it and allocating it
    again leaves it at the same addresses and the decode CUDA graphs survive (otherwise they are captured
    again after every release): auto (with release_kv_during_train, where the driver supports it) | on |
    off. Such a pool is outside torch's allocator: torch.cuda.memory_allocated does not count it."""
    page_size: int = 1
    """KV page size in tokens."""
    radix_cache: bool = True
    """Share prompt prefixes across requests through the radix cache."""
    cuda_graph: bool = True
    """Capture decode in CUDA graphs (GPU only)."""
    cuda_graph_piecewise_min_batch: int = 256
    """Decode batches of at least this many requests replay their graph in pieces, with each layer's
    attention run eagerly in between (planned for the real batch: no forced split-KV and merge; ~2 launches
    per layer of host time, hidden behind the long steps of a large batch); 0 = never."""
    fused_kernels: str = "auto"
    """Fused kernels for the engine's forwards and sampling: RMSNorm / RoPE / SwiGLU compiled; q/k
    norm+RoPE (with the KV-cache write), the sampler's block totals and the MoE router and experts at decode
    sizes as Triton kernels:
    auto (CUDA with bf16/fp16) | on | off."""
    flashinfer_kernel: str = "fa2"
    """flashinfer's attention kernel family: fa2 | fa3 (Hopper; compiles its own kernels on first use)."""
    flashinfer_decode: str = "auto"
    """flashinfer's decode attention: auto | tensor-cores | cuda-cores. auto takes tensor cores from 4 query
    heads per KV head up (Qwen3-4B/8B/30B-A3B) and flashinfer's CUDA-core decode kernel below (Qwen3-0.6B and
    1.7B have 2), where it reads the KV faster."""
    overlap_schedule: str = "auto"
    """Plan step t+1 while the device runs step t: auto (on for CUDA) | on | off. Off in deterministic mode."""
    deterministic: bool = False
    """Batch-invariant kernels so a request's result does not depend on its batch."""
    speculative: str = "off"
    """Speculative decoding, exact (the same samples as without): off | ngram (drafts from the request's own
    tokens) | draft (drafts from a smaller model, `spec_draft_model`) | head (drafts from a small head over the
    model's own hidden states, `spec_head`)."""
    spec_draft_model: str | None = None
    """The draft model of speculative=draft: a checkpoint folder (or builtin: / init: / smollm2: as for
    model.path) with the model's tokenizer; loaded in the model's dtype on its device."""
    spec_head: str | None = None
    """The draft head of speculative=head: a folder written by `miles train` (checkpoints/step_N/draft_head);
    unset: a new head (train it with spec_draft_train)."""
    spec_head_intermediate_size: int = 0
    """MLP width of a new draft head; 0: the model's MLP width."""
    spec_draft_tokens: int = 4
    """Most draft tokens verified per request and step."""
    spec_draft_train: bool = False
    """In `miles train`: train the draft model (speculative=draft: masked NLL of the sampled response tokens,
    a Monte-Carlo estimate of KL(policy || draft)) or the draft head (speculative=head: KL from the policy's
    distributions at each of its spec_draft_tokens steps) online on every step's rollouts, so its drafts
    follow the policy as it learns. The samples stay plain decoding's either way; only the acceptance rate
    changes."""
    spec_draft_lr: float = 1e-4
    """AdamW learning rate of the draft's online training (constant; trainer.optim's other settings)."""
    spec_draft_train_epochs: int = 1
    """Optimizer steps of the draft per RL step, each over all of the step's samples."""
    spec_min_accept_length: float = 0.0
    """Speculate only while the tokens kept per request and verify step (a moving average) are at least this;
    below it decode steps run plain (overlap-scheduled where overlap_schedule is on), and one step in every
    spec_probe_every speculates to measure it again. 0: always speculate. The break-even is a speculative
    step's time over a plain one's (`miles bench rollout` with and without --speculative). Counts steps, not
    time, so runs stay reproducible."""
    spec_probe_every: int = 16
    """Plain decode steps between two probes while spec_min_accept_length closes the gate."""
    spec_ngram_max: int = 3
    """Longest suffix n-gram looked up for a draft."""
    spec_ngram_min: int = 1
    """Shortest suffix n-gram looked up for a draft."""
    seed: int = 0
    """Base sampling seed (each request derives its own)."""
    update_policy: str = "retract"
    """What update_weights does with requests in flight: finish | retract."""
    record_routing: bool = False
    """Record MoE expert choices per token (for routing replay)."""
    generate_fn: str | None = None
    """Multi-turn generate plugin (`pkg.mod:func` or `path/file.py:func`, an `async def generate(client,
    sample, params)`, rollout/multiturn.py); None: single-turn generation."""
    generate_timeout_s: float = 1800.0
    """A generate plugin call running longer costs its sample (aborted); 0: no limit (a plugin that never
    returns then holds the run)."""


@dataclass
class OptimConfig:
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    schedule: str = "constant"
    """constant | cosine (after warm-up)."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""


@dataclass
class TrainerConfig:
    backend: str = "torch"
    """torch (our model) | megatron (megatron-core layers, trainer/megatron/policy.py) | deepspeed (ZeRO over
    the data-parallel ranks, trainer/deepspeed/policy.py)."""
    max_steps: int = 100
    """RL steps (rollout + update) to run."""
    lr: float = 1e-5
    """Peak learning rate."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    global_batch_size: int = 128
    """Samples per optimizer step; a rollout batch is split into rollout_size / global_batch_size steps."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch (gradient accumulation across micro-batches)."""
    epochs_per_rollout: int = 1
    """Passes over each rollout batch (PPO epochs)."""
    precision: str = "fp32"
    """fp32 | bf16 (autocast over float32 weights). With model.dtype=bfloat16 the forward is bf16 either way."""
    master_weights: bool = True
    """With bf16 weights (model.dtype=bfloat16): AdamW updates float32 copies, gradients are summed in
    float32, and each step's result is rounded into the weights the engine samples from; false updates the
    bf16 weights in place (an update below a weight's rounding step, ~0.4 % of it, is then lost)."""
    tensor_parallel_size: int = 1
    """megatron backend: processes that split one model replica's layers (megatron's tensor parallelism; a
    divisor of placement.num_processes); the replicas are data-parallel. 1: each process holds a replica."""
    expert_parallel_size: int = 1
    """megatron backend, MoE models: processes that split each MoE layer's experts (megatron's expert
    parallelism: its all-to-all token dispatcher); divides placement.num_processes and the expert count."""
    expert_tensor_parallel_size: int | None = None
    """megatron backend, MoE models: processes that split each expert's intermediate dimension (None:
    trainer.tensor_parallel_size, megatron's default); times expert_parallel_size, divides the processes."""
    zero_stage: int = 2
    """deepspeed backend: ZeRO stage 1 (optimizer state sharded), 2 (and gradients) or 3 (and weights)."""
    offload_optimizer: str = "none"
    """deepspeed backend: none | cpu (the optimizer state and step in host memory)."""
    offload_param: str = "none"
    """deepspeed backend, zero_stage=3: none | cpu (the weight shards in host memory between uses)."""
    deepspeed_extra: dict[str, Any] = field(default_factory=dict)
    """deepspeed backend: keys merged over the DeepSpeed config built from these settings
    (trainer/deepspeed/config.py), e.g. +trainer.deepspeed_extra.zero_optimization.reduce_bucket_size=5e7."""
    fused_kernels: str = "auto"
    """auto | on | off: the torch backend's elementwise chains (RMSNorm, residual add + norm, q/k norm + RoPE,
    SwiGLU) through torch.compile, forward and backward, as the engine runs them; auto: on CUDA in bf16."""
    seed: int = 0
    """Torch seed."""
    save_every: int = 0
    """Write an HF checkpoint every N steps (0: only at the end)."""
    save_final: bool = True
    """Write an HF checkpoint at the end."""
    keep_last: int = 0
    """Keep only the newest N checkpoints of the run (0: all)."""
    resume_from: str = ""
    """Resume an RL run: a checkpoints/step_N folder, a run folder (its latest step), or `auto` (the latest
    step of the newest run of this recipe). Checkpoints carry the optimizer and loader state (miles/resume.py)."""
    eval_every: int = 10
    """Greedy eval on the held-out split every N steps (0 disables; always at start and end when on)."""
    eval_max_new_tokens: int | None = None
    """Eval response length cap (None: rollout.max_new_tokens)."""
    sft_epochs: float = 1.0
    """SFT only: passes over the dataset when algorithm=sft."""
    sft_batch_size: int = 64
    """SFT only: samples per optimizer step."""
    stop_after_failed_steps: int = 5
    """Stop the run after this many consecutive steps that could not learn: every sample's reward errored, or
    no update was taken (no usable sample, or every optimizer step skipped for a non-finite gradient). 0: warn
    at each such step and go on."""
    async_rollout: str = "off"
    """off | one_step: the next step's rollout runs while this step's update does (on the weights one update
    older: each sample's `weight_version` says which; `train/staleness_*`), the engines synced after both.
    Needs engines of their own (placement.mode=ray, or placement.engine_process) and algorithm.tis."""
    routing_replay: bool = False
    """MoE: route each token through the experts the engine chose at rollout (needs rollout.record_routing)."""
    peak_flops: float = 0.0
    """Device peak FLOP/s for train/mfu; 0 looks up known GPUs and omits train/mfu when unknown (CPU)."""
    distributed_optimizer: bool = False
    """Shard the float32 master weights, AdamW moments and reduced gradients over the data-parallel ranks
    (trainer/distributed_optimizer/adamw.py): gradients reduce-scattered, updated weights all-gathered; checkpoints then
    hold each rank's shards (torch.distributed.checkpoint). It always keeps float32 master slices (whatever
    trainer.master_weights says)."""
    recompute: str = "none"
    """Activation recomputation in the backward: none | selective (attention and MLP internals) | full
    (each whole layer); torch and megatron backends (trainer/recompute.py)."""
    offload_optimizer_during_rollout: bool = False
    """Move the optimizer's float32 masters and moments to pinned CPU memory between updates (CUDA only; a
    no-op on CPU), so a colocated engine's KV pool can use that memory; `time/offload` is logged."""


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    """Name of the preset (grpo | dr_grpo | gspo | sft); `sft` runs the supervised loop instead of RL."""
    advantage: str = "grpo"
    """Advantage estimator registered in miles.trainer.algorithms (grpo, reinforce, ...) or `pkg.mod:func`."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (False = Dr. GRPO)."""
    policy_loss: str = "ppo_clip"
    """Policy loss registered in miles.trainer.algorithms or `pkg.mod:func`."""
    clip_low: float = 0.2
    """PPO ratio lower clip epsilon."""
    clip_high: float = 0.2
    """PPO ratio upper clip epsilon (clip-higher when > clip_low)."""
    loss_agg: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss; 0 disables the reference model."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (entropy is always logged)."""
    tis: bool = True
    """Truncated importance sampling against the rollout logprobs."""
    tis_cap: float = 2.0
    """Upper cap of the TIS ratio."""
    group_filter: str = ""
    """Dynamic sampling (DAPO): train only on the groups this filter keeps, topping the step up with groups of
    further prompts (trainer/group_filter.py). `nonzero_std` keeps groups whose rewards are not all equal;
    `pkg.mod:func` / `path/file.py:func` takes one group's scored samples and returns True to keep it.
    "" = off (every group trains)."""
    filter_max_batches: int = 4
    """With `group_filter`: at most this many batches of `rollout.rollout_batch_size` prompts are generated a
    step; if the kept groups are still fewer, the step trains on those."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response longer than `rollout.max_new_tokens - overlong_buffer`
    tokens loses up to `overlong_penalty` of its reward, linearly, all of it at `max_new_tokens`. Applied after
    `group_filter` (which sees the rewards as scored) and before the advantages. 0 = off."""
    overlong_penalty: float = 1.0
    """The most a response loses to `overlong_buffer`."""


@dataclass
class RewardConfig:
    fn: str = "math"
    """Built-in name (math, exact_match, format, code, judge, remote) or `pkg.mod:func` or `path/file.py:func`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the reward function."""
    batched: bool = False
    """The function takes the whole list of samples."""
    timeout_s: float = 10.0
    """Hard per-call timeout; a reward past it scores 0 and counts in reward/errors and reward/timeouts."""
    num_workers: int = 2
    """Process-pool size for CPU-bound graders; 0 scores built-ins in-process (user code still gets 2
    workers unless `in_process`)."""
    in_process: bool = False
    """Run user reward code (file or module) in the trainer's process: no memory cap and no hard kill, so an
    exit, crash or fork there ends the run."""
    worker_memory_mb: int = 4096
    """Address space each reward worker may add past its start-up size (0 = no cap; CUDA in a reward needs 0)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Several rewards combined: {fn: weight}; each is logged as reward/<name>/mean."""
    score_during_rollout: bool = True
    """Start the worker pool's rewards of a group as soon as its samples finish generating, while the rest
    of the batch still generates (single-turn rollouts; the scores are the same either way)."""
    by_data_source: dict[str, str] = field(default_factory=dict)
    """Route samples to a reward by their data_source: {data_source: fn}."""


@dataclass
class PlacementConfig:
    mode: str = "embedded"
    """embedded (each process one device, its engine and trainer sharing weights) | ray."""
    num_processes: int = 1
    """Data-parallel processes of the embedded placement, one device each (`cuda:<local rank>`, or CPU):
    each generates its share of the batch's groups and the gradients are summed across them. `miles train`
    starts them itself; under torchrun leave it at 1 (the launcher's WORLD_SIZE decides)."""
    num_engines: int = 0
    """ray: engine actors behind the router (0: one per trainer rank). Colocated: one per trainer rank."""
    colocate: bool = True
    """ray: each engine actor shares its trainer rank's device (synced by cuda_ipc / shm from that rank);
    false: engines on devices of their own, synced by broadcast from trainer rank 0."""
    ray_address: str = ""
    """ray: the cluster to join (`auto`, or host:port of `ray start --head`); empty joins RAY_ADDRESS's
    cluster if set, else starts a local one."""
    cpus_per_actor: float = 1.0
    """ray: CPUs each trainer rank and each engine actor reserves (a local cluster gets at least what the
    run reserves, so the default fits a laptop)."""
    engine_hang_s: float = 120.0
    """ray: an engine busy with requests that makes no step for this long is hung: it is killed, restarted
    with the current weights and its requests resubmitted."""
    max_engine_restarts: int = 3
    """ray: engine restarts one generate call may make before the step fails."""
    cpu_threads: int = 1
    """torch intra-op threads on CPU (tiny models run fastest on 1; 0 keeps torch's default)."""
    engine_process: bool = False
    """embedded: the engine in a process of its own beside the trainer's, on the same device, its weights
    pushed by `weight_sync.transport` after every update (false: the engine runs the trainer's own module)."""


@dataclass
class WeightSyncConfig:
    transport: str = "auto"
    """auto | inprocess (the engine in the trainer's process) | cuda_ipc (colocated GPU processes) | shm (CPU
    shared memory between processes) | broadcast (a trainer-rank-0 + engines process group: NCCL / gloo).
    auto: inprocess, or with placement.engine_process cuda_ipc on a GPU and shm on CPU."""
    bucket_mb: int = 512
    """Size of one flat bucket; cuda_ipc / shm keep 2 of them allocated on the trainer's side all along."""
    timeout_s: float = 300.0
    """How long one side waits for the other's next answer before the sync fails naming it."""


@dataclass
class LoggingConfig:
    wandb: bool = True
    """Log to W&B (offline automatically when no WANDB_API_KEY)."""
    wandb_project: str = "miles"
    """W&B project."""
    wandb_mode: str = "auto"
    """auto | online | offline."""
    samples_per_step: int = 4
    """Rows written to samples.jsonl per step."""
    progress: bool = True
    """Rich progress bar."""
    plot_every: int = 5
    """Redraw plots/reward.png every N steps."""


@dataclass
class MilesConfig:
    recipe: str = "grpo_math"
    """Name of the recipe this config came from."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
