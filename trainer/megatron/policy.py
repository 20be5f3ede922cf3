"""`MegatronPolicy`: a megatron-core `GPTModel` behind the trainer's model interface (`trainer.backend=megatron`).

The policy is built from megatron-core's own layers (its local spec: ColumnParallel/RowParallel linears,
RMSNorm, q/k layernorm, TopKRouter and the MoE token dispatcher), so the trainer updates megatron's modules
and its optimizer state is keyed by megatron's names. Four pieces are ours, each in a slot megatron exposes:

  * the core attention: megatron's unfused `DotProductAttention` has no packed-sequence path without
    Transformer Engine, so each layer hands q/k/v to the same varlen attention the torch backend uses (the
    per-layer attention kernel is a spec slot megatron exposes for exactly this);
  * RoPE angles: computed per token from the packed positions with our model's frequencies (Llama-3
    scaling included), then applied by megatron's `apply_rotary_pos_emb`;
  * the routers' gating (logits in float32 with autocast off, on the weight's own device);
  * the experts: megatron's grouped-GEMM experts need Transformer Engine or the `grouped_gemm` package, and
    its `SequentialMLP` loops over experts, so `GroupedExperts` (megatron/experts.py) takes the dispatcher's
    permuted tokens into torch's grouped GEMMs.

`PolicyTrainer` drives it unchanged (`forward_packed`, `lm_head`, `args`, `device`, `dtype`); the engine keeps
its own `CausalLM`, which the weight sync fills from `engine_weights()` (megatron's layout converted, see
megatron/layout.py), with the checksum proving both sides agree after every step.

The same code runs on CPU (CI, debugging) and CUDA: megatron-core's CUDA-only paths (its causal mask, RoPE
table and router gating, which moves the router weight to the current GPU) are among those replaced.
Tensor parallelism (`tensor_parallel`): megatron's parallel layers hold this rank's parts; `load_from`
splits whole weights, `gather`/`engine_weights` put them back together, and the LM head's logprobs are
vocabulary-parallel (vocab_parallel.py). Expert parallelism (`expert_parallel`) and expert tensor parallelism
split the stacked experts over ranks through megatron's all-to-all dispatcher; MoE layers under TP run on a
slice of the tokens; routing replay goes through the routers (megatron/parallel.py). Pipeline parallelism is
not wired; replicas are data-parallel as with the torch backend.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import tempfile
import types
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from miles.errors import MilesUserError
from miles.models import CausalLM, ModelArgs, RoutingTrace
from miles.models.attention import AttentionContext
from miles.models.layers import RotaryEmbedding
from miles.models.model import ForwardOutput
from miles.trainer.megatron.experts import GroupedExperts
from miles.trainer.megatron.gating import float32_logits
from miles.trainer.megatron.layout import (
    expert_shard,
    expert_unshard,
    from_megatron,
    is_expert,
    to_megatron,
    tp_partial_gradient,
    tp_partition,
    tp_shard,
    tp_unshard,
)
from miles.trainer.megatron.parallel import (
    ParallelSizes,
    RoutingState,
    build_alltoall_dispatcher_on_cpu,
    check_parallel_sizes,
    cpu_dispatcher,
    install_cpu_collectives,
    install_routing,
    moe_layer_indices,
    split_moe_over_tp,
)
from miles.trainer.vocab_parallel import check_token_ids

# megatron-core warns at import about optional packages (apex, Transformer Engine) and deprecations that
# concern its own training scripts, not this use; a missing import still raises.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:  # megatron-core is optional: the torch backend needs none of it
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.module import MegatronModule
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        from megatron.core.transformer.transformer_config import TransformerConfig

        MEGATRON_IMPORT_ERROR: Exception | None = None
    except ImportError as err:  # pragma: no cover - exercised where megatron-core is absent
        MEGATRON_IMPORT_ERROR = err
        MegatronModule = nn.Module  # type: ignore[misc,assignment]


def require_megatron() -> None:
    if MEGATRON_IMPORT_ERROR is not None:
        raise MilesUserError(
            f"trainer.backend=megatron needs megatron-core ({MEGATRON_IMPORT_ERROR}); install it with "
            "pip install 'megatron-core>=0.16' (or use trainer.backend=torch)"
        )


def check_megatron_supports(args: ModelArgs, tensor_parallel: int = 1) -> None:
    """What this backend's megatron mapping covers; anything else fails at start with what to do."""
    if args.attention_bias or args.mlp_bias:
        raise MilesUserError(
            "trainer.backend=megatron maps models without linear biases (Qwen3, Qwen3-MoE, Llama); this model "
            "has attention_bias or mlp_bias set: use trainer.backend=torch"
        )
    if RotaryEmbedding(args).attention_factor != 1.0:
        raise MilesUserError(
            "trainer.backend=megatron does not apply YaRN's attention scaling; use trainer.backend=torch"
        )
    if args.num_experts and args.num_experts_per_tok == 1 and args.norm_topk_prob:
        # Qwen3-MoE's renormalised top-1 weighs each token's expert by exactly 1: megatron's router would
        # take a softmax over the one chosen logit, which its config refuses (zero router gradient)
        raise MilesUserError(
            "trainer.backend=megatron cannot represent a Qwen3-MoE router with num_experts_per_tok=1 and "
            "norm_topk_prob=true (megatron-core refuses a top-1 softmax router without pre-softmax); use "
            "trainer.backend=torch"
        )
    if tensor_parallel > 1:
        sizes = {
            "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": args.num_key_value_heads,
            "intermediate_size": args.intermediate_size,
        }
        uneven = {k: v for k, v in sizes.items() if v % tensor_parallel}
        if uneven:
            raise MilesUserError(
                f"trainer.tensor_parallel_size={tensor_parallel} must divide the model's {uneven}; "
                "pick a size that divides them"
            )


def ensure_process_groups(
    device: torch.device,
    tensor_parallel: int = 1,
    sizes: ParallelSizes | None = None,
    args: ModelArgs | None = None,
) -> None:
    """megatron-core needs torch.distributed and its model-parallel groups, even in one process.

    A run of several processes (miles/distributed/) has its process group already; one process gets a
    world of one over a file store (no port to pick). Megatron's groups: `tensor_parallel` consecutive ranks
    share one model replica; `sizes.expert` x `sizes.etp` ranks split the experts; pipeline size is 1.
    """
    sizes = sizes or ParallelSizes(tensor=tensor_parallel)
    import torch.distributed as dist

    if not dist.is_initialized():
        store_file = os.path.join(tempfile.mkdtemp(prefix="miles-megatron-"), "store")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=dist.FileStore(store_file, 1),
            rank=0,
            world_size=1,
        )
        atexit.register(_destroy_world_of_one)
    if dist.get_world_size() % tensor_parallel:
        raise MilesUserError(
            f"trainer.tensor_parallel_size={tensor_parallel} must divide the {dist.get_world_size()} processes "
            "(placement.num_processes)"
        )
    if args is not None:
        check_parallel_sizes(args, dist.get_world_size(), sizes)
    if parallel_state.model_parallel_is_initialized() and (
        parallel_state.get_data_parallel_world_size() * tensor_parallel != dist.get_world_size()
        or parallel_state.get_tensor_model_parallel_world_size() != tensor_parallel
        or parallel_state.get_expert_model_parallel_world_size() != sizes.expert
        or parallel_state.get_expert_tensor_parallel_world_size() != sizes.etp
    ):
        parallel_state.destroy_model_parallel()  # groups of an earlier process group or other sizes
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=sizes.expert,
            expert_tensor_parallel_size=sizes.etp,
        )
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        if not get_cuda_rng_tracker().is_initialized():
            # It reseeds the default CUDA generator too; the run's (rollout seeds, data order) stays as it was.
            state = torch.cuda.get_rng_state_all()
            model_parallel_cuda_manual_seed(torch.initial_seed() % (2**31))
            torch.cuda.set_rng_state_all(state)


_VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _destroy_world_of_one() -> None:
    """At exit, the group `ensure_process_groups` created (NCCL warns of a leak otherwise)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class PackedState:
    """The attention context of the forward in progress, shared by every layer's core attention."""

    def __init__(self) -> None:
        self.attention: AttentionContext | None = None


class PackedCoreAttention(MegatronModule):
    """Megatron's core-attention slot filled with the trainer's varlen attention over packed sequences.

    q [s, 1, heads, d] and k/v [s, 1, groups, d] arrive after q/k layernorm and RoPE; the output is
    [s, 1, heads * d], as megatron's `DotProductAttention` returns.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any = None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        packing: PackedState | None = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        if packing is None:
            raise ValueError("PackedCoreAttention needs the policy's PackedState")
        self.packing = packing
        self.layer_index = layer_number - 1  # megatron counts layers from 1
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        attention = self.packing.attention
        if attention is None or query.shape[1] != 1:
            raise RuntimeError("PackedCoreAttention runs inside MegatronPolicy.forward_packed only")
        out = attention.attend(self.layer_index, query[:, 0], key[:, 0], value[:, 0], self.scale)
        return out.reshape(query.shape[0], 1, -1)


def transformer_config(
    args: ModelArgs,
    dtype: torch.dtype,
    device: torch.device,
    tensor_parallel: int = 1,
    sizes: ParallelSizes | None = None,
) -> TransformerConfig:
    sizes = sizes or ParallelSizes(tensor=tensor_parallel)
    moe: dict[str, Any] = {}
    if args.num_experts:
        moe = dict(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.num_experts_per_tok,
            moe_ffn_hidden_size=args.moe_intermediate_size,
            moe_router_score_function="softmax",
            # Qwen3-MoE's softmax over all experts then top-k renormalised (norm_topk_prob) is a softmax
            # over the top-k logits: megatron's post-softmax; without renormalisation it is pre-softmax.
            moe_router_pre_softmax=not args.norm_topk_prob,
            moe_router_load_balancing_type="none",  # the torch backend has no auxiliary loss either
            # router logits in float32 (as megatron recommends for MoE); its gating function also has no
            # autocast handling, so under bf16 autocast its backward would mix dtypes otherwise
            moe_router_dtype="fp32",
            moe_aux_loss_coeff=0.0,
            # all-to-all over the EP ranks, with variable token counts per rank (CPU: megatron/parallel.py)
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            expert_model_parallel_size=sizes.expert,
            expert_tensor_parallel_size=sizes.etp,
        )
    return TransformerConfig(
        num_layers=args.num_hidden_layers,
        hidden_size=args.hidden_size,
        tensor_model_parallel_size=tensor_parallel,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,  # the weights are copied in from the model right after
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **moe,
    )


def _layer_specs(args: ModelArgs, packing: PackedState) -> TransformerBlockSubmodules:
    attention = ModuleSpec(module=PackedCoreAttention, params={"packing": packing})
    specs = []
    for layer in range(args.num_hidden_layers):
        spec = get_gpt_layer_local_spec(
            num_experts=args.num_experts if args.is_moe_layer(layer) else None,
            moe_grouped_gemm=False,
            qk_layernorm=args.qk_norm,
            normalization="RMSNorm",
        )
        spec.submodules.self_attention.submodules.core_attention = attention
        if args.is_moe_layer(layer):
            _moe_submodules(spec.submodules.mlp).experts = GroupedExperts
        specs.append(spec)
    # The final norm named explicitly: megatron's default picks Transformer Engine's or apex's when they are
    # installed (apex's has no RMSNorm), while the local spec's per-layer norms are always torch's.
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=WrappedTorchNorm)


def _moe_submodules(mlp_spec: Any) -> Any:
    """The MoE layer's submodules in a layer spec: a `ModuleSpec`'s (megatron-core 0.16) or, since the MoE
    layer became a builder, its `functools.partial`'s keyword (0.19)."""
    if isinstance(mlp_spec, functools.partial):
        return mlp_spec.keywords["submodules"]
    return mlp_spec.submodules


def _float32_gating(router: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A router's logits in float32 with autocast off. megatron's own gating is an autograd function without
    autocast handling (under bf16 autocast its backward mixes bf16 and float32), and it first moves the
    router weight to `torch.cuda.current_device()`, which fails for a CPU model."""
    return float32_logits(hidden, router.weight, router.bias)  # backward keeps the bf16 hidden states


class MegatronPolicy(nn.Module):
    """A megatron-core GPTModel with the interface `PolicyTrainer` and `packed_logprobs` use."""

    def __init__(
        self,
        args: ModelArgs,
        dtype: torch.dtype,
        device: torch.device,
        tensor_parallel: int = 1,
        expert_parallel: int = 1,
        expert_tensor_parallel: int | None = None,
    ) -> None:
        super().__init__()
        require_megatron()
        check_megatron_supports(args, tensor_parallel)
        sizes = ParallelSizes(tensor_parallel, expert_parallel, expert_tensor_parallel)
        if not args.num_experts:
            sizes = ParallelSizes(tensor_parallel, expert_parallel, expert_tensor_parallel or 1)
        ensure_process_groups(device, tensor_parallel, sizes, args)
        if args.num_experts:
            install_cpu_collectives(device, sizes)
        self.args = args
        self.sizes = sizes
        self.tensor_parallel_size = tensor_parallel
        self.tensor_parallel_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tensor_parallel_group = (
            parallel_state.get_tensor_model_parallel_group() if tensor_parallel > 1 else None
        )
        """The ranks that hold the parts of this replica (None: the whole model is here)."""
        self.data_parallel_group = parallel_state.get_data_parallel_group()
        self.expert_data_parallel_group = parallel_state.get_expert_data_parallel_group()
        """The ranks holding the same experts (on other data), over which expert gradients sum."""
        self.expert_group = (
            parallel_state.get_expert_tensor_and_model_parallel_group() if sizes.experts_split else None
        )
        """The ranks holding the other parts of the experts (EP x expert-TP; None: whole experts here)."""
        self.lockstep = sizes.experts_split
        """Whether every forward (and backward) is a collective across ranks training on different samples
        (the experts' all-to-all): each rank must then run as many micro-batches as the others."""
        self._expert_coords: list[tuple[int, int]] = []
        if self.expert_group is not None:
            import torch.distributed as dist

            mine = (
                parallel_state.get_expert_model_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_rank(),
            )
            self._expert_coords = [None] * self.expert_group.size()  # type: ignore[list-item]
            dist.all_gather_object(self._expert_coords, mine, group=self.expert_group)
        # The vocabulary splits evenly over the TP ranks once padded with rows no token uses (megatron's
        # `make_vocab_size_divisible_by`); the padding never leaves the policy: logprobs mask it, and the
        # weights and optimizer state it gathers are cut back to the model's vocabulary.
        self.padded_vocab_size = -(-args.vocab_size // tensor_parallel) * tensor_parallel
        self._packing = PackedState()
        self._routing = RoutingState()

        def build() -> GPTModel:
            with warnings.catch_warnings():
                # per-layer deprecation notes about megatron's own argument defaults, and its note that
                # EP x TP wants sequence parallelism (the MoE layers run sequence-split: megatron/parallel.py)
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.filterwarnings(
                    "ignore", message="When using expert parallelism and tensor parallelism"
                )
                return GPTModel(
                    config=transformer_config(args, dtype, device, tensor_parallel, sizes),
                    transformer_layer_spec=_layer_specs(args, self._packing),
                    vocab_size=self.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    position_embedding_type="rope",
                    rotary_base=int(args.rope_theta),
                    share_embeddings_and_output_weights=args.tie_word_embeddings,
                )

        self.gpt = build_alltoall_dispatcher_on_cpu(build) if device.type == "cpu" else build()
        moe_index = moe_layer_indices(args)
        for name, module in self.gpt.named_modules():
            if hasattr(module, "gating") and hasattr(module, "routing"):  # megatron's MoE routers
                module.gating = types.MethodType(_float32_gating, module)
                layer = int(name.split(".")[2])  # decoder.layers.<i>.mlp.router
                install_routing(module, moe_index[layer], args, self._routing)
            if hasattr(module, "token_dispatcher") and hasattr(module, "experts"):  # megatron's MoE layers
                if device.type == "cpu":
                    cpu_dispatcher(module.token_dispatcher)
                if tensor_parallel > 1:
                    split_moe_over_tp(module, self.tensor_parallel_group, self._routing)
        # Megatron's local-spec norms are built in float32 whatever `params_dtype` says (its Float16Module
        # casts them in megatron's own training loop): held in the model's dtype, as the engine runs them.
        for param in self.gpt.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        self.rotary = RotaryEmbedding(args)
        self.to(device)

    @classmethod
    def from_model(
        cls,
        model: CausalLM,
        tensor_parallel: int = 1,
        expert_parallel: int = 1,
        expert_tensor_parallel: int | None = None,
    ) -> MegatronPolicy:
        """A megatron copy of `model`'s weights (this rank's parts), on its device and in its dtype."""
        policy = cls(
            model.args, model.dtype, model.device, tensor_parallel, expert_parallel, expert_tensor_parallel
        )
        policy.load_from(model)
        return policy

    @torch.no_grad()
    def load_from(self, model: CausalLM) -> None:
        """Copy every weight of `model` in (each megatron parameter must be written exactly once)."""
        own = dict(self.gpt.named_parameters())
        written: set[str] = set()
        for name, whole in to_megatron(model.named_parameters(), self.args):
            tensor = self.shard(name, whole)
            if name not in own or own[name].shape != tensor.shape:
                raise KeyError(
                    f"megatron has no parameter {name!r} of shape {tuple(tensor.shape)}"
                    f"{'' if name not in own else f' (it has {tuple(own[name].shape)})'}"
                )
            own[name].copy_(tensor)
            written.add(name)
        if written != set(own):
            raise KeyError(f"megatron parameters left unwritten: {sorted(set(own) - written)[:8]}")

    def engine_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights in the engine model's names and layouts, all at once (`iter_engine_weights`)."""
        return list(self.iter_engine_weights())

    def iter_engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights in the engine model's names and layouts, one at a time (detached; q/k/v regrouped
        into copies; with tensor parallelism gathered from every TP rank: a collective of the TP group,
        which every rank must run to the end)."""
        named = ((n, self.gather(n, p.detach())) for n, p in self.gpt.named_parameters())
        return from_megatron(named, self.args)

    def is_sharded(self, name: str) -> bool:
        """Whether ranks hold different parts of megatron parameter `name` (TP-split, or an expert weight split
        by expert parallelism / expert-TP), else the same whole tensor."""
        name = name.removeprefix("gpt.")
        if is_expert(name):
            return self.sizes.experts_split
        return self.tensor_parallel_size > 1 and tp_partition(name) is not None

    def gradient_groups(self, name: str) -> tuple[Any, Any]:
        """(the group its gradient sums over, the group holding its other parts or None) for parameter `name`.

        For the trainer's gradient sum and clipping, and any sharded optimizer: a dense parameter's gradient
        sums over megatron's data-parallel group, an expert weight's over the expert-data-parallel group (the
        ranks holding the same experts); a split parameter's squared norm sums over the second group (the TP
        group, or the EP x expert-TP group for experts), a whole one counts once. q/k norms' and routers'
        gradients are first summed over TP (`reduce_tensor_parallel_gradients`)."""
        if is_expert(name.removeprefix("gpt.")):
            return self.expert_data_parallel_group, self.expert_group
        return self.data_parallel_group, self.tensor_parallel_group if self.is_sharded(name) else None

    def gradient_reduction_group(self, name: str) -> Any:
        """The group parameter `name`'s gradient sums over when it is not megatron's data-parallel group (an
        expert weight split by expert parallelism: the expert-data-parallel group), else None."""
        group, _ = self.gradient_groups(name)
        return None if group is self.data_parallel_group else group

    def shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor laid out like megatron parameter `name`."""
        name = name.removeprefix("gpt.")  # the policy's own parameter names carry its submodule's
        if is_expert(name):
            ep_rank, etp_rank = (
                (
                    parallel_state.get_expert_model_parallel_rank(),
                    parallel_state.get_expert_tensor_parallel_rank(),
                )
                if self.sizes.experts_split
                else (0, 0)
            )
            return expert_shard(name, whole, ep_rank, self.sizes.expert, etp_rank, self.sizes.etp)
        pad = self.padded_vocab_size - self.args.vocab_size
        if pad and name in _VOCAB_PARAMETERS and whole.dim():
            whole = torch.cat([whole, whole.new_zeros(pad, *whole.shape[1:])])
        return tp_shard(name, whole, self.tensor_parallel_rank, self.tensor_parallel_size)

    def reduce_tensor_parallel_gradients(self, named_grads: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Sum over the TP group the gradients (by this module's parameter names: the parameters' own, or
        their float32 master copies') that are each rank's share of a whole parameter's (megatron does this
        in its `finalize_model_grads`, which this trainer does not run)."""
        if self.tensor_parallel_size == 1:
            return
        import torch.distributed as dist

        for name, grad in named_grads:
            if tp_partial_gradient(name.removeprefix("gpt.")):
                dist.all_reduce(grad, group=self.tensor_parallel_group)

    def gather(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's `part` of parameter `name` (a collective of the TP group, or for
        an expert weight of the EP x expert-TP group)."""
        if not self.is_sharded(name):
            return part
        import torch.distributed as dist

        if is_expert(name.removeprefix("gpt.")):
            parts = [torch.empty_like(part) for _ in range(self.expert_group.size())]
            dist.all_gather(parts, part.contiguous(), group=self.expert_group)
            placed = dict(zip(self._expert_coords, parts))
            return expert_unshard(name.removeprefix("gpt."), placed, self.sizes.expert, self.sizes.etp)
        parts = [torch.empty_like(part) for _ in range(self.tensor_parallel_size)]
        dist.all_gather(parts, part.contiguous(), group=self.tensor_parallel_group)
        name = name.removeprefix("gpt.")
        whole = tp_unshard(name, parts)
        return whole[: self.args.vocab_size] if name in _VOCAB_PARAMETERS else whole

    @property
    def lm_head(self) -> nn.Module:
        """The module whose `.weight` is the output projection (the embedding when tied)."""
        if self.args.tie_word_embeddings:
            return self.gpt.embedding.word_embeddings
        return self.gpt.output_layer

    @property
    def device(self) -> torch.device:
        return self.gpt.embedding.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.gpt.embedding.word_embeddings.weight.dtype

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        routing: RoutingTrace | None = None,
    ) -> ForwardOutput:
        """N tokens of packed sequences ([N] ids and positions) -> final-norm hidden states [N, hidden].

        `routing` (MoE): `replay` [num_moe_layers, N, top_k] routes each token through those experts;
        `record` returns the experts used as `ForwardOutput.routing` [num_moe_layers, N, top_k] (ascending
        ids per token, where the engine's are in score order)."""
        # an id past the vocabulary would look up a zero padding row, or none, on a TP rank: refused
        check_token_ids(input_ids, self.args.vocab_size, "input")
        self._packing.attention = attn
        replay = routing.replay if routing is not None else None
        self._routing.replay = replay
        self._routing.recorded = {} if routing is not None and routing.record else None
        inv_freq = self.rotary.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        rotary = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # megatron's [s, 1, 1, d] angles
        try:
            hidden = self.gpt.embedding(input_ids=input_ids[None], position_ids=positions[None])  # [N, 1, H]
            hidden = self.gpt.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)
        finally:
            # the replay stays set until the next forward: a layer recomputed in the backward replays it too
            recorded, self._routing.recorded = self._routing.recorded, None
        stacked = None
        if recorded:
            stacked = torch.stack([recorded[i] for i in sorted(recorded)])
            routing.recorded.extend(stacked.unbind(0))  # type: ignore[union-attr]
        return ForwardOutput(hidden=hidden[:, 0], routing=stacked)
