"""Reductions whose backward compares the saved input with the saved result (amax and
the others of lightning_acgc.engine.exact): the result is recomputed from the values the
input's holder unpacks, so the gradient stays finite and lands on the decoded maxima.
Compressed apart, the comparison found no maximum and the gradient was NaN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.engine.exact import recompute_fn, recompute_plan
from tests._reductions import SCATTER_REDUCTIONS

REDUCTIONS = {
    "amax_dim": lambda t: t.amax(-1),
    "amax_keepdim": lambda t: t.amax((1, 2), keepdim=True),
    "amax_all": lambda t: t.amax(),
    "amin_dim": lambda t: t.amin(1),
    "max": lambda t: t.max(),
    "min": lambda t: t.min(),
    "median": lambda t: t.median(),
    "nanmedian": lambda t: t.nanmedian(),
    "inf_norm": lambda t: torch.linalg.vector_norm(t, float("inf"), dim=-1),
    "neg_inf_norm": lambda t: torch.linalg.vector_norm(t, float("-inf")),
    **SCATTER_REDUCTIONS,  # a GNN's max aggregation
}


class Reduce(nn.Module):
    """A weight times the input (an exact product for the half codec below), reduced."""

    def __init__(self, reduction) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))
        self.reduction = reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.reduction(x * self.w)
        return (r * torch.arange(1.0, r.numel() + 1, device=r.device).view_as(r)).sum()


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 12, 16, generator=g).half().float()  # exact in float16


def _grad(model: nn.Module, x: torch.Tensor, **compression) -> torch.Tensor:
    model.w.grad = None
    if compression:
        with compress_activations(model=model, min_numel=0, **compression) as stats:
            model(x).backward()
        assert any(r.codec == "recomputed" for r in stats.sites.values())
    else:
        model(x).backward()
    return model.w.grad.clone()


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_exactly_decoded_input_gives_the_plain_gradient(name: str) -> None:
    """With a codec that decodes these values exactly (float16), the recomputed result
    equals the saved one: the gradient is plain autograd's, bit for bit."""
    model, x = Reduce(REDUCTIONS[name]), _inputs()
    plain = _grad(model, x)
    assert torch.equal(_grad(model, x, codec="half"), plain)


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("bits", [2, 8])
def test_quantized_input_gives_a_finite_gradient(name: str, bits: int) -> None:
    model, x = Reduce(REDUCTIONS[name]), _inputs()
    grad = _grad(model, x, codec="quant", bits=bits)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


class StableSoftmaxAttention(nn.Module):
    """Attention with a hand-written stable softmax (scores - scores.amax(-1))."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        scores = scores - scores.amax(-1, keepdim=True)
        p = scores.exp()
        return self.out((p / p.sum(-1, keepdim=True) @ x).mean(1))


def test_stable_softmax_attention_trains_compressed() -> None:
    """The pattern that gave NaN query and key gradients under 4-bit quantization."""
    torch.manual_seed(0)
    model, x, y = StableSoftmaxAttention(), torch.randn(8, 64, 32), torch.randint(0, 5, (8,))
    F.cross_entropy(model(x), y).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with compress_activations(model=model, codec="quant", bits=8, min_numel=0):
        F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n
    # the whole gradient (k.bias's is 0 up to rounding: softmax ignores a shift per row)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref = torch.cat([g.flatten() for g in plain.values()])
    assert (got - ref).norm() / ref.norm() < 0.05


def test_small_input_in_a_chunk_and_a_shared_input() -> None:
    """The input's holder is a member of a chunk of small tensors (coalesced), and is
    shared with the ReLU that saved the same tensor first; a second backward
    (retain_graph) recomputes again."""
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16).half().float()

    def loss() -> torch.Tensor:
        h = F.relu(lin(x))
        return (h.amax(0) * torch.arange(16.0)).sum()

    loss().backward()
    plain = lin.weight.grad.clone()
    lin.weight.grad = None
    with compress_activations(
        model=lin, codec="half", min_numel=1024, coalesce_min_numel=16
    ) as stats:
        out = loss()
    out.backward(retain_graph=True)
    first = lin.weight.grad.clone()
    out.backward()
    assert torch.equal(first, plain) and torch.equal(lin.weight.grad, 2 * plain)
    codecs = {r.codec for r in stats.sites.values()}
    assert "recomputed" in codecs and "half" in codecs


def test_recompute_pairs_only_the_reductions_own_input() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    h = x * 2
    r = h.amax(1)
    assert recompute_fn(r, h) is not None
    assert recompute_fn(r, x) is None  # not its input
    assert recompute_fn(r, None) is None
    assert recompute_fn(h.norm(), h) is None  # a 2-norm compares nothing
    assert recompute_fn(h.max(1).values, h) is None  # saves indices instead
    nan = h.clone()
    nan[0, 0] = float("nan")
    assert recompute_fn(nan.amax(1), nan) is None  # NaN != NaN: the result is kept
    assert recompute_fn(x.amax(), x) is not None  # a leaf's reduction


def test_scatter_plan_takes_index_self_and_src() -> None:
    src = torch.randn(6, 2, requires_grad=True) * 1
    index = torch.tensor([0, 1, 0, 1, 0, 1])[:, None].expand(6, 2)
    start = torch.zeros(2, 2)
    out = start.scatter_reduce(0, index, src, "amax")
    assert recompute_plan(out, [index, start, src])[1] == 3
    assert recompute_plan(out, [start, index, src]) is None  # not its index
    assert recompute_plan(out, [index, start, None]) is None  # an input no longer alive
    summed = start.scatter_reduce(0, index, src, "sum")
    assert recompute_plan(summed, [index, start, src]) is None  # a sum compares nothing


def test_a_site_that_does_not_recur_under_acgc() -> None:
    """acgc calibrating every step on a model whose second layer runs on even steps only
    (its site's width stays in the policy's table; the log read it from the step's sites
    and raised KeyError). The error of such a step is not promised: the settings come
    from the sites of the step before."""
    from lightning_acgc import ActivationCompressor, build_policy, compressed_step
    from lightning_acgc.engine.settings import EngineSettings

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh())
    head = nn.Linear(64, 1)
    policy = build_policy("acgc", warmup_steps=6)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=0))
    engine.install()
    policy.setup(model)
    x = torch.randn(32, 16)
    try:
        for step in range(6):
            layers = model if step % 2 == 0 else model[:2]
            loss = lambda f=layers: head(f(x)[:, :64]).square().mean()
            compressed_step(engine, model, loss, step)
            assert all(
                torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
            )
        assert "avg_bits" in policy.metrics()
    finally:
        engine.remove()
        policy.teardown()


def test_pairing_on_a_device_checks_shapes_only() -> None:
    """Off the CPU the pairing compares shape and dtype (meta tensors), not values:
    comparing values would wait for the device at each such save."""
    from lightning_acgc.engine.exact import _reproduces

    x = torch.randn(4, 8, device="meta")
    amax = lambda t: t.amax(-1)
    assert _reproduces(amax, (x,), torch.empty(4, device="meta"))
    assert not _reproduces(amax, (x,), torch.empty(8, device="meta"))
    assert not _reproduces(amax, (x,), torch.empty(4, device="meta", dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["amax_keepdim", "scatter_amax", "inf_norm"])
def test_reductions_on_cuda(name: str) -> None:
    """The recomputed results on a GPU (Triton codecs, deferred checks): finite, and the
    float16 codec's exact decode gives plain autograd's gradient."""
    model, x = Reduce(REDUCTIONS[name]).cuda(), _inputs().cuda()
    plain = _grad(model, x)
    assert torch.equal(_grad(model, x, codec="half"), plain)
    assert torch.isfinite(_grad(model, x, codec="quant", bits=2)).all()
