"""Sampling in torch with the exact logprob of each sampled token.

Distribution (the order of transformers' logits warpers): logits / temperature, then top-k (the k most
likely tokens, and every token tied with the k-th, as transformers and vLLM keep them), then top-p on the
renormalised top-k distribution (the smallest set of most likely tokens whose mass reaches top_p, with a tie
at its boundary kept whole), then min-p (tokens at least min_p times the most likely one after temperature).
min-p is relative, so it commutes with top-k; it does not commute with top-p: vLLM applies it before top-k /
top-p, where the nucleus is then taken over the min-p-renormalised mass and can be smaller. Tokens with equal
logits are always equally likely. The returned logprob is log q(token) where q is that filtered,
renormalised distribution: the one the token was actually drawn from.

Greedy (temperature 0) returns the argmax. Nothing is drawn, so there is no sampling distribution; by
convention its logprob is the one under the unfiltered temperature-1 distribution, log_softmax(logits),
which is what a trainer scoring the same token at temperature 1 recomputes.

Randomness: one uniform number per (request seed, response position), made on the host by a counter-based
hash (splitmix64), so a request's draws do not depend on the batch it runs in, on preemption, or on the
device, nor on what the other rows of a step ask for. The token is drawn by inverse CDF, in vocabulary order
and accumulated in float64 so that even very unlikely tokens keep their probability, over the weights
exp(logits / temperature - max) (no normalisation: their float64 total scales the uniform number), those of
the tokens a filter drops set to 0; so a row without filters draws the same token whether or not other rows
of its step filter.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from miles.models import fused
from miles.rollout.forward_batch import host_to_device
from miles.rollout.sampling import triton_kernel

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


_MASK64 = (1 << 64) - 1


def _splitmix64_int(x: int) -> int:
    """`_splitmix64` of one value, in Python integers (no array round trip for a single seed)."""
    z = (x + int(_GOLDEN)) & _MASK64
    z = ((z ^ (z >> 30)) * int(_MIX1)) & _MASK64
    z = ((z ^ (z >> 27)) * int(_MIX2)) & _MASK64
    return z ^ (z >> 31)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (e.g. the user's seed and the sample index within its group)."""
    h = 0
    for part in parts:
        h = _splitmix64_int(h ^ (part & _MASK64))
    return h >> 1


def prompt_key(prompt: list[int]) -> int:
    """A 63-bit hash of a prompt's token ids (blake2b, stable across processes and machines), for seeds."""
    digest = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def uniforms(seeds: list[int] | np.ndarray, positions: list[int] | np.ndarray) -> np.ndarray:
    """u in [0, 1) (53 random bits) for each (seed, response position) pair; vectorised, batch independent."""
    return uniforms_of_mixed(mix_seeds(seeds), positions)


def mix_seeds(seeds: list[int] | np.ndarray) -> np.ndarray:
    """The seeds' half of `uniforms`, which a caller drawing for the same requests step after step can keep."""
    return _splitmix64(np.asarray(seeds, dtype=np.uint64))


def uniforms_of_mixed(mixed: np.ndarray, positions: list[int] | np.ndarray) -> np.ndarray:
    """`uniforms` from seeds already through `mix_seeds`."""
    h = _splitmix64(mixed ^ np.asarray(positions, dtype=np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * (2.0**-53)


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one step, on the logits' device."""

    temperature: torch.Tensor
    """[B] float32; 0 marks greedy rows."""
    top_k: torch.Tensor
    """[B] int64; vocab size when off."""
    top_p: torch.Tensor
    """[B] float32."""
    min_p: torch.Tensor
    """[B] float32."""
    uniform: torch.Tensor
    """[B] float64 in [0, 1)."""
    any_greedy: bool
    all_greedy: bool
    any_filter: bool
    unit_temperature: bool = False
    """Every row has temperature 0 or 1, so no row needs dividing (x / 1 == x exactly)."""

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        uniform: np.ndarray,
        vocab_size: int,
        device: torch.device,
    ) -> SamplingTensors:
        k = [vocab_size if kk <= 0 or kk > vocab_size else kk for kk in top_k]
        any_filter = (
            any(kk < vocab_size for kk in k) or any(p < 1.0 for p in top_p) or any(m > 0 for m in min_p)
        )
        greedy = [t == 0.0 for t in temperature]
        return cls(
            temperature=host_to_device(torch.tensor(temperature, dtype=torch.float32), device),
            top_k=host_to_device(torch.tensor(k, dtype=torch.int64), device),
            top_p=host_to_device(torch.tensor(top_p, dtype=torch.float32), device),
            min_p=host_to_device(torch.tensor(min_p, dtype=torch.float32), device),
            uniform=host_to_device(np.ascontiguousarray(uniform, dtype=np.float64), device),
            any_greedy=any(greedy),
            all_greedy=all(greedy),
            any_filter=any_filter,
            unit_temperature=all(t in (0.0, 1.0) for t in temperature),
        )

    def rows(self, index: torch.Tensor | slice) -> SamplingTensors:
        return SamplingTensors(
            self.temperature[index],
            self.top_k[index],
            self.top_p[index],
            self.min_p[index],
            self.uniform[index],
            self.any_greedy,
            self.all_greedy,
            self.any_filter,
            self.unit_temperature,
        )


def _filter_sorted(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scaled logits in descending order [B, V], their token ids [B, V], which of them the filters drop).

    Tokens with equal logits are kept or dropped together, so that they stay equally likely whatever their
    ids: top-k keeps every token at least as likely as the k-th (transformers' `TopKLogitsWarper`, vLLM);
    top-p keeps the smallest run of most likely tokens whose mass reaches top_p and every token tied with
    its last one (as FlashInfer's top-p sampling does; a plain cumulative sum keeps the tied tokens that the
    sort happens to put first). top_p = 1 drops nothing (a running sum can round up to 1 before the last
    tokens)."""
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True)
    vocab = scaled.shape[-1]
    kth = sorted_logits.gather(-1, (top_k - 1).clamp(0, vocab - 1)[:, None])
    dropped = sorted_logits < kth
    # Masses of the weights the draw uses, exp(scaled - max) (so p / max p), summed in float64: a float32
    # softmax and running sum over a large vocabulary are off by ~1e-5 of the mass, and the nucleus would
    # hold less than top_p.
    weights = (sorted_logits - sorted_logits[:, :1]).exp().masked_fill(dropped, 0.0)
    cumulative = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    mass_before = F.pad(cumulative[:, :-1], (1, 0)).div_(cumulative[:, -1:])
    del cumulative
    beyond = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    del mass_before
    last = ((~beyond).sum(dim=-1, keepdim=True) - 1).clamp(min=0)  # the plain rule's last kept token
    dropped = dropped | (beyond & (sorted_logits < sorted_logits.gather(-1, last)))
    dropped = dropped | (weights < min_p[:, None])
    dropped[:, 0] = False  # the most likely token always survives
    return sorted_logits, sorted_ids, dropped


def filtered_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted log q for rows with filters: returns (logq [B, V] in descending order, token ids [B, V]).

    Dropped tokens have log q = -inf. `temperature` must be > 0 on every row.
    """
    sorted_logits, sorted_ids, dropped = _filter_sorted(logits / temperature[:, None], top_k, top_p, min_p)
    return torch.log_softmax(sorted_logits.masked_fill(dropped, float("-inf")), dim=-1), sorted_ids


def kept_tokens(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """[B, V] bool in vocabulary order: the tokens the filters keep (all of them on a row without filters).

    Each filter keeps the tokens at least as likely as some token, ties included, so together they keep
    those whose logit reaches the least likely kept one's: one comparison in vocabulary order instead of a
    scatter of the sorted mask (the same set)."""
    sorted_logits, _, dropped = _filter_sorted(scaled, top_k, top_p, min_p)
    kept = (~dropped).sum(dim=-1, keepdim=True)  # >= 1: the most likely token always stays
    return scaled >= sorted_logits.gather(-1, kept - 1)


_CDF_BLOCK = 1024


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index drawn from each row of `weights` (probabilities up to a per-row scale) by inverse CDF,
    accumulated in float64; and each row's total weight (float64).

    Two levels keep it cheap on a large vocabulary: pick a block of 1024 tokens from the blocks' masses,
    then a token inside that block. Neither level ever picks a zero-probability block or token.
    """
    rows, vocab = weights.shape
    if vocab <= _CDF_BLOCK:
        # One block (101 tokens for the char model): the two levels below reduce to this, bit for bit (the
        # block's offset inside its row is exactly 0), in a third of the ops.
        probs = weights.double()
        total = probs.sum(dim=-1, keepdim=True)
        token = _draw(torch.cumsum(probs, dim=-1), uniform[:, None] * total).squeeze(-1)
        return token, total.squeeze(-1)
    size = _CDF_BLOCK
    pad = (-vocab) % size
    probs = torch.empty(rows, vocab + pad, dtype=torch.float64, device=weights.device)
    probs[:, :vocab] = weights  # one float64 copy, padded, that the sums below share
    if pad:
        probs[:, vocab:] = 0.0
    blocks = probs.view(rows, -1, size)
    mass = blocks.sum(dim=-1)
    cdf = torch.cumsum(mass, dim=-1)
    target = uniform[:, None] * cdf[:, -1:]
    block = _draw(cdf, target)
    inside = target - (cdf.gather(-1, block) - mass.gather(-1, block))
    flat = torch.arange(rows, device=probs.device) * blocks.shape[1] + block.squeeze(-1)
    inner_cdf = torch.cumsum(blocks.view(-1, size).index_select(0, flat), dim=-1)
    token = (block * size + _draw(inner_cdf, inside)).squeeze(-1)
    return token.clamp_(max=vocab - 1), cdf[:, -1]  # the clamp only ever moves NaN rows out of the padding


def _draw(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[rows, 1] index of the first entry of each (non-decreasing) cdf row above target, capped at the last
    entry that adds mass: the first one that reaches the row's total, found by bisection like the draw.
    Rows of NaN (e.g. the padding rows of deterministic mode) still get an index in range."""
    drawn = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous())
    return torch.minimum(drawn, last).clamp_(max=cdf.shape[-1] - 1)


def block_masses(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max of logits / temperature [B, 1] float32, float64 total of the weights exp(scaled - max) over each
    block of _CDF_BLOCK tokens [B, blocks]). The reference for `triton_kernel`'s one-pass kernel, and its
    fallback compiled (fused kernels on): it reads the logits twice and writes only the block totals, where
    `_inverse_cdf` writes a float64 copy of every weight."""
    scaled = logits.float() / temperature[:, None]
    top = scaled.amax(dim=-1, keepdim=True)
    weights = (scaled - top).exp()
    padded = F.pad(weights, (0, (-weights.shape[-1]) % _CDF_BLOCK))
    return top, padded.double().view(weights.shape[0], -1, _CDF_BLOCK).sum(dim=-1)


def _sample_from_block_masses(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfiltered draw of `sample` (inverse CDF over exp(scaled - max), two levels) without the
    [B, V] float64 weights: the block is drawn from the block totals, then the weights of that one block
    are recomputed from the logits."""
    rows, vocab = logits.shape
    masses = triton_kernel.block_masses_or_none(logits, temperature, _CDF_BLOCK)
    top, mass = masses if masses is not None else fused.call(block_masses, logits, temperature)
    cdf = torch.cumsum(mass, dim=-1)
    total = cdf[:, -1]
    target = uniform[:, None] * total[:, None]
    block = _draw(cdf, target)
    inside = target - (cdf.gather(-1, block) - mass.gather(-1, block))
    index = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=logits.device)
    in_vocab = index < vocab
    picked = logits.gather(-1, index.clamp(max=vocab - 1)).float() / temperature[:, None]
    weights = torch.where(in_vocab, (picked - top).exp(), 0.0).double()
    offset = _draw(torch.cumsum(weights, dim=-1), inside)
    tokens = (block * _CDF_BLOCK + offset).clamp_(max=vocab - 1)
    chosen = logits.gather(-1, tokens).float() / temperature[:, None]
    return tokens.squeeze(-1), ((chosen - top).squeeze(-1) - total.log()).float()


def draws_from_block_masses(params: SamplingTensors, device: torch.device) -> bool:
    """Whether `sample` takes the unfiltered draw from block totals (the Triton kernel's, else the compiled
    `block_masses`), whose temporaries are [B, blocks], not [B, V]."""
    return not params.any_filter and not params.all_greedy and fused.compiling() and device.type == "cuda"


MAX_TOP_LOGPROBS = 20
"""Most alternatives returned per token (OpenAI's limit)."""


def top_alternatives(
    logits: torch.Tensor, params: SamplingTensors, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` most likely tokens of each row and their logprobs under the distribution the row samples
    from (the one the sampled token's logprob is taken under): logits / temperature, filtered and
    renormalised where the row filters, and for a greedy row the temperature-1 log-softmax. Tokens a filter
    drops come last with -inf. -> (token ids [B, count] int64, logprobs [B, count] float32)."""
    logits = logits.float()
    greedy = params.temperature == 0.0
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    if params.any_filter:
        # A greedy row's convention is the unfiltered distribution: no filter for it.
        vocab = logits.shape[-1]
        top_k = torch.where(greedy, torch.full_like(params.top_k, vocab), params.top_k)
        top_p = torch.where(greedy, torch.ones_like(params.top_p), params.top_p)
        min_p = torch.where(greedy, torch.zeros_like(params.min_p), params.min_p)
        logq, ids = filtered_logprobs(logits, temperature, top_k, top_p, min_p)
        return ids[:, :count], logq[:, :count]
    values, ids = torch.log_softmax(logits / temperature[:, None], dim=-1).topk(count, dim=-1)
    return ids, values


def sample(logits: torch.Tensor, params: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> (token ids [B] int64, logprobs [B] float32), no host sync."""
    if params.all_greedy:
        logits = logits.float()
        tokens = torch.argmax(logits, dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    temperature = params.temperature
    if params.any_greedy:
        temperature = torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)
    if draws_from_block_masses(params, logits.device):
        tokens, logprobs = _sample_from_block_masses(logits, temperature, params.uniform)
    else:
        logits = logits.float()
        scaled = logits if params.unit_temperature else logits / temperature[:, None]
        # No softmax over the vocabulary: the draw scales with the total of the weights exp(scaled - max),
        # and log q(token) = (scaled - max)[token] - log(total).
        top = scaled.amax(dim=-1, keepdim=True)
        weights = (scaled - top).exp_()
        if params.any_filter:
            # The kept tokens' weights, in vocabulary order as for unfiltered rows (the most likely token is
            # always kept, so `top` is the kept maximum): a row without filters draws the very token, with
            # the very logprob, it draws in a step where no row filters.
            keep = kept_tokens(scaled, params.top_k, params.top_p, params.min_p)
            weights = weights.masked_fill_(~keep, 0.0)
        tokens, total = _inverse_cdf(weights, params.uniform)
        logprobs = ((scaled.gather(-1, tokens[:, None]) - top).squeeze(-1) - total.log()).float()
    if params.any_greedy:  # rows of temperature 0 take the argmax and its temperature-1 logprob
        logits = logits.float()  # a no-op where the branch above already converted
        greedy = params.temperature == 0.0
        argmax = torch.argmax(logits, dim=-1)
        greedy_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, argmax[:, None]).squeeze(-1)
        tokens = torch.where(greedy, argmax, tokens)
        logprobs = torch.where(greedy, greedy_logprobs, logprobs)
    return tokens, logprobs
