"""Layout ops read off the autograd graph and replayed (lightning_acgc.engine.layout_chain):
each step a saved tensor went through after the op that made it, on 2-D and 4-D
products, with the steps' negative dimensions and several-output nodes."""

from __future__ import annotations

import pytest
import torch

from lightning_acgc.engine.layout_chain import layout_chain


def _qkv(y: torch.Tensor, i: int) -> torch.Tensor:
    """A fused projection split into heads as the char-LM recipe does: q, k, v by unbind."""
    return y.view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)[i]


STEPS = {
    "view_transpose_copy": lambda y: y.view(2, 5, 3, 8).transpose(1, 2).reshape(6, 5, 8),
    "negative_transpose": lambda y: y.view(2, 5, 24).transpose(-1, -2).contiguous(),
    "permute_expand": lambda y: y.view(2, 5, 3, 8).permute(0, 2, 1, 3).expand(2, 3, 5, 8),
    "t": lambda y: y.t(),
    "unbind_q": lambda y: _qkv(y, 0),
    "unbind_v_matmul_copy": lambda y: _qkv(y, 2).transpose(-1, -2).reshape(4, 4, 5),
    "unbind_tuple": lambda y: list(y.view(10, 3, 8).unbind(1))[1],
    "split": lambda y: y.split(10, dim=-1)[2],
    "chunk_view": lambda y: y.chunk(3, dim=1)[1].reshape(2, 5, 8),
    "split_sizes": lambda y: y.split([4, 12, 8], dim=1)[1],
    "select_negative": lambda y: y.view(10, 3, 8)[:, -1],
    "slice_step": lambda y: y[1:9:2, 3:],
    "unsqueeze_squeeze": lambda y: y.unsqueeze(-1).transpose(0, 2).squeeze(0),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_replay_gives_the_saved_tensor(name):
    x = torch.randn(10, 6, requires_grad=True)
    y = torch.nn.functional.linear(x, torch.randn(24, 6), torch.randn(24))
    t = STEPS[name](y)
    chain = layout_chain(t, lambda node: node is y.grad_fn)
    assert chain is not None and chain.start is y.grad_fn and chain.shape == (10, 24)
    got = chain.replay(y.detach())
    assert got.shape == t.shape and torch.equal(got, t.detach())


def test_another_op_on_the_way_ends_the_walk():
    y = torch.randn(10, 24, requires_grad=True) * 1.0
    assert layout_chain((y.view(2, 5, 24) * 2).transpose(1, 2), lambda n: n is y.grad_fn) is None
    assert layout_chain(y.view(2, 5, 24), lambda n: False) is None
    assert layout_chain(torch.randn(3), lambda n: True) is None  # no graph


def test_an_expand_of_an_unknown_size_is_not_replayed():
    """An unbind drops a size the walk cannot know (-1): a reshape before it infers the
    size, an expand before it is refused."""
    y = torch.randn(10, 24, requires_grad=True) * 1.0
    reshaped = y.view(10, 3, 8).unbind(1)[0]
    assert layout_chain(reshaped, lambda n: n is y.grad_fn) is not None
    expanded = y.view(10, 1, 24).expand(10, 3, 24).unbind(1)[0]
    assert layout_chain(expanded, lambda n: n is y.grad_fn) is None


def test_a_chain_longer_than_the_bound_is_refused():
    y = torch.randn(4, 6, requires_grad=True) * 1.0
    t = y
    for _ in range(20):
        t = t.t()
    assert layout_chain(t, lambda n: n is y.grad_fn) is None
