"""The MoE experts' training forward (miles/models/routed_experts.py) against the autograd chain it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import miles.models.moe as moe
from miles.models.moe import Experts

E, H, FF, N, K = 6, 32, 12, 40, 2


def autograd_chain(
    experts: Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, grouped: bool = False
) -> torch.Tensor:
    """The ops `Experts.forward` ran under autograd before `routed_experts`: gather by indexing, a linear per
    expert over unbound weights (or the grouped GEMMs), silu(gate) * up, weighting, index_add_."""
    n, k = chosen.shape
    flat = chosen.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    token_of = order // k
    sorted_x = x[token_of]
    counts = torch.bincount(flat, minlength=experts.num_experts)
    if grouped:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(sorted_x, experts.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(
            2, -1
        )
        out = torch._grouped_mm(F.silu(gate) * up, experts.down_proj.transpose(-2, -1), offs=offsets)
    else:
        outs, start = [], 0
        gate_ups, downs = experts.gate_up_proj.unbind(0), experts.down_proj.unbind(0)
        for expert, count in enumerate(counts.tolist()):
            if count:
                gate, up = F.linear(sorted_x[start : start + count], gate_ups[expert]).chunk(2, -1)
                outs.append(F.linear(F.silu(gate) * up, downs[expert]))
            start += count
        out = torch.cat(outs)
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token_of, out)


def per_token_loop(
    experts: Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The layer's definition, one token and slot at a time."""
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros_like(x[t])
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            total = total + weights[t, j] * (experts.down_proj[e] @ (F.silu(gate) * up))
        rows.append(total)
    return torch.stack(rows)


def setup(
    dtype: torch.dtype = torch.float32,
) -> tuple[Experts, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    experts = Experts(E, H, FF).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * FF, H, generator=gen) * 0.3)
        experts.down_proj.copy_(torch.randn(E, H, FF, generator=gen) * 0.3)
    first = torch.randint(0, E - 1, (N,), generator=gen)
    chosen = torch.stack([first, (first + 1) % (E - 1)], dim=1)  # the last expert gets no token
    x = torch.randn(N, H, generator=gen, dtype=dtype)
    weights = torch.rand(N, K, generator=gen, dtype=dtype)
    grad_out = torch.randn(N, H, generator=gen, dtype=dtype)
    return experts, x, chosen, weights, grad_out


def values_and_grads(fn, experts: Experts, x, chosen, weights, grad_out) -> list[torch.Tensor]:  # noqa: ANN001
    x = x.detach().clone().requires_grad_(True)
    weights = weights.detach().clone().requires_grad_(True)
    out = fn(experts, x, chosen, weights)
    params = [experts.gate_up_proj, experts.down_proj]
    grads = torch.autograd.grad((out.float() * grad_out.float()).sum(), [x, weights, *params])
    return [out.detach(), *grads]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("grouped", [False, True], ids=["per_expert", "grouped"])
def test_float32_values_are_the_chains_and_gradients_match_it(grouped: bool, monkeypatch) -> None:
    if grouped:  # the CUDA training path's grouped GEMMs, run on CPU
        monkeypatch.setattr(Experts, "_training_gemms", lambda self, x: (True, x.dtype))
    experts, *inputs = setup()
    ours = values_and_grads(Experts.__call__, experts, *inputs)
    chain = values_and_grads(lambda *a: autograd_chain(*a, grouped=grouped), experts, *inputs)
    assert torch.equal(ours[0], chain[0])  # the forward runs the same ops
    for got, want in zip(ours[1:], chain[1:]):  # x, gating weights, gate_up_proj, down_proj
        assert relative(got, want) <= 1e-6
    assert ours[3][E - 1].abs().sum() == 0 and ours[4][E - 1].abs().sum() == 0  # no token, no gradient


def test_float64_matches_the_per_token_definition() -> None:
    experts, *inputs = setup(torch.float64)
    ours = values_and_grads(Experts.__call__, experts, *inputs)
    plain = values_and_grads(per_token_loop, experts, *inputs)
    for got, want in zip(ours, plain):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bf16_autocast_values_are_the_chains_and_gradients_as_accurate() -> None:
    # float32 master weights under bf16 autocast: the GEMMs and the activation in bf16, as autocast ran them
    experts, *inputs = setup()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = values_and_grads(Experts.__call__, experts, *inputs)
        chain = values_and_grads(autograd_chain, experts, *inputs)
    exact = values_and_grads(
        autograd_chain,
        experts.double(),
        *(t.double() for t in inputs[:1]),
        inputs[1],
        *(t.double() for t in inputs[2:]),
    )
    assert torch.equal(ours[0], chain[0])
    assert [g.dtype for g in ours[1:]] == [g.dtype for g in chain[1:]]
    for got, want, truth in zip(ours[1:], chain[1:], exact[1:]):
        assert relative(got, want) < 2e-2 and relative(got, truth) < 2e-2


def test_frozen_experts_still_give_the_inputs_gradients() -> None:
    experts, x, chosen, weights, grad_out = setup()
    experts.requires_grad_(False)
    results = []
    for fn in (Experts.__call__, autograd_chain):
        x_ = x.clone().requires_grad_(True)
        w_ = weights.clone().requires_grad_(True)
        results.append(torch.autograd.grad((fn(experts, x_, chosen, w_) * grad_out).sum(), [x_, w_]))
    for got, want in zip(*results):
        assert relative(got, want) <= 1e-6


def test_backward_keeps_the_first_projection_and_no_routed_token_rows() -> None:
    # what autograd keeps, through saved_tensors_hooks: x (shared with the router), the gating weights, the
    # [pairs, 2 FF] first projection and the routing's integers; before, also four [pairs, H or FF] copies
    experts, x, chosen, weights, _ = setup()
    x.requires_grad_(True)
    weights.requires_grad_(True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(x, chosen, weights)
    params = {p.data_ptr() for p in experts.parameters()}
    floats = {t.data_ptr(): t for t in saved if t.is_floating_point() and t.data_ptr() not in params}
    assert sorted(tuple(t.shape) for t in floats.values()) == sorted([(N, H), (N, K), (N * K, 2 * FF)])


def test_the_engines_no_grad_forward_does_not_take_the_training_function(monkeypatch) -> None:
    experts, x, chosen, weights, _ = setup()
    monkeypatch.setattr(
        moe, "routed_experts", lambda *a: pytest.fail("a no-grad forward took routed_experts")
    )
    with torch.no_grad():
        experts(x, chosen, weights)
    with torch.inference_mode():
        experts(x, chosen, weights)
