"""The lossless ``intpack`` codec: exact round trips on adversarial integer tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_acgc.codecs import build_codec
from lightning_acgc.policies.fixed import FixedPolicy

INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


@st.composite
def int_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(INT_DTYPES))
    info = torch.iinfo(dtype)
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 30), min_size=ndim, max_size=ndim)))
    n = int(torch.Size(shape).numel())
    kind = draw(st.sampled_from(["narrow", "full", "extremes", "constant", "sorted"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if kind == "narrow":
        lo = draw(st.integers(info.min, info.max - 20))
        x = torch.randint(0, 20, (n,), generator=g, dtype=torch.int64) + lo
    elif kind == "full":
        x = torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), (n,), generator=g)
    elif kind == "extremes":
        x = torch.tensor([info.min, info.max, 0, -1 if info.min < 0 else 1] * n)[:n]
    elif kind == "constant":
        x = torch.full((n,), draw(st.integers(info.min, info.max)), dtype=torch.int64)
    else:
        x = torch.randint(-5 if info.min < 0 else 0, 5, (n,), generator=g).cumsum(0)
        x = x.clamp(info.min, info.max)
    x = x.to(dtype).view(shape)
    if draw(st.booleans()) and x.dim() >= 2:
        x = x.transpose(0, -1)
    return x


@settings(max_examples=150, deadline=None)
@given(x=int_tensors(), group=st.sampled_from([8, 64, 256]))
def test_intpack_is_lossless(x: torch.Tensor, group: int) -> None:
    codec = build_codec("intpack", {"group_size": group})
    packed = codec.encode(x, seed=0)
    if packed is None:  # packing would not shrink it: the engine keeps it raw
        return
    y = codec.decode(packed)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_intpack_int_extremes_in_one_group(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    x = torch.tensor([info.min, info.max] * 2048, dtype=dtype)
    codec = build_codec("intpack", {"group_size": 8})
    packed = codec.encode(x, seed=0)
    if packed is not None:
        assert torch.equal(codec.decode(packed), x)


def test_intpack_pooling_indices_shrink() -> None:
    x = torch.randn(8, 16, 32, 32)
    _, idx = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    codec = build_codec("intpack", {})
    packed = codec.encode(idx, seed=0)
    assert torch.equal(codec.decode(packed), idx)
    assert idx.numel() * 8 / packed.nbytes > 5  # 1024 positions per plane: ~10 bits


def test_intpack_declines_floats_and_bools_and_keeps_empty() -> None:
    codec = build_codec("intpack", {})
    assert codec.encode(torch.randn(10), 0) is None
    assert codec.encode(torch.ones(10, dtype=torch.bool), 0) is None
    e = torch.empty(0, 3, dtype=torch.int64)
    assert torch.equal(codec.decode(codec.encode(e, 0)), e)


def test_intpack_rejects_bad_group_size() -> None:
    with pytest.raises(ValueError, match="group_size=7 must be a positive multiple of 8"):
        build_codec("intpack", {"group_size": 7})


class FloatsRaw(FixedPolicy):
    """Compresses no float tensor (the engine still packs integers with ``intpack``)."""

    def codec_for(self, site, x):  # type: ignore[no-untyped-def]
        return None


def test_engine_packs_pooling_indices_losslessly() -> None:
    """The engine routes saved integer tensors (MaxPool's indices) to ``intpack``: with
    the floats kept raw (a policy that compresses no float), gradients stay
    bit-identical and the indices shrink."""
    from lightning_acgc import compress_activations

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.MaxPool2d(2), torch.nn.Flatten()
    )
    x = torch.randn(4, 3, 32, 32)

    def grads(**options) -> tuple[list[torch.Tensor], object]:
        model.zero_grad()
        if not options:
            model(x).square().sum().backward()
            return [p.grad.clone() for p in model.parameters()], None
        # compress_loss: the loss's square() outside the model goes to the policy (kept)
        with compress_activations(
            model=model, keep_packed=True, compress_loss=True, **options
        ) as stats:
            model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()], stats

    plain, _ = grads()
    packed, stats = grads(policy=FloatsRaw())
    assert all(torch.equal(a, b) for a, b in zip(plain, packed, strict=True))
    ints = [p for p in stats.packed if p.codec == "intpack"]
    assert len(ints) == 1 and ints[0].dtype == torch.int64
    assert ints[0].nbytes * 5 < ints[0].shape.numel() * 8


def test_expanded_index_costs_its_distinct_values() -> None:
    codec = build_codec("intpack", {})
    idx = torch.randint(0, 10_000, (5000,))
    expanded = idx.view(-1, 1).expand(5000, 64)  # scatter's index.expand_as(src)
    packed = codec.encode(expanded, seed=0)
    assert torch.equal(codec.decode(packed), expanded)
    assert packed.nbytes < idx.numel() * 8 / 3  # not 64 copies of each value


def test_views_of_one_storage_share_one_packed_copy_decoded_once(monkeypatch) -> None:
    from lightning_acgc.codecs import intpack as intpack_module

    codec = build_codec("intpack", {})
    edge_index = torch.randint(0, 1000, (2, 4096))
    row, col = edge_index[1], edge_index[1].view(-1, 1).expand(4096, 8)
    first, second = codec.encode(row, seed=0), codec.encode(col, seed=0)
    assert first.nbytes > 0 and second.nbytes == 0  # counted once
    calls = []
    real = intpack_module.intpack_decode
    monkeypatch.setattr(
        intpack_module, "intpack_decode", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    for _ in range(2):  # two backward passes: one decode each
        assert torch.equal(codec.decode(second), col)
        assert torch.equal(codec.decode(first), row)
    assert len(calls) == 2
    edge_index.add_(1)  # a new version is packed anew
    assert codec.encode(edge_index[1], seed=0).nbytes > 0


def test_engine_packs_a_shared_edge_index_once() -> None:
    """Two message-passing layers save views of one ``edge_index``: the integer bytes are
    counted once, each backward decodes them once, and the gradients are exact."""
    from lightning_acgc import compress_activations
    from lightning_acgc.codecs import intpack as intpack_module

    g = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, 2000, (2, 20_000), generator=g)
    x = torch.randn(2000, 16, generator=g)
    lins = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward() -> torch.Tensor:
        h = x
        for lin in lins:
            msg = lin(h).index_select(0, edge_index[0])
            index = edge_index[1].view(-1, 1).expand_as(msg)
            h = torch.zeros_like(h).scatter_add(0, index, msg).relu()
        return h.square().sum()

    forward().backward()
    exact = [p.grad.clone() for p in lins.parameters()]
    lins.zero_grad()
    decodes = []
    real = intpack_module._Source.view

    def counting(self, *args):
        decodes.append(self._decoded is None)
        return real(self, *args)

    intpack_module._Source.view = counting
    try:
        with compress_activations(
            policy=FloatsRaw(), min_numel=0, model=lins, compress_loss=True
        ) as stats:
            forward().backward()
    finally:
        intpack_module._Source.view = real
    for p, e in zip(lins.parameters(), exact, strict=True):
        torch.testing.assert_close(p.grad, e)
    int_sites = [s for s in stats.sites.values() if s.codec == "intpack"]
    assert len(int_sites) >= 4  # two views in each of the two layers
    packed = sum(s.packed_bytes for s in int_sites)
    assert packed < edge_index.numel() * 8 / 4  # both rows packed once, not per use
    assert sum(decodes) <= 2  # one decode per packed row, not per use


def test_equal_values_in_another_storage_share_the_packed_copy() -> None:
    """Each GCN layer recomputes the same normalized ``edge_index``: packed once."""
    codec = build_codec("intpack", {})
    a = torch.randint(0, 1000, (2, 4096))
    b = a.clone()  # equal values, another storage
    c = a.clone()
    c[0, 5], c[0, 6] = c[0, 5] + 1, c[0, 6] - 1  # same sum, first and last: not equal
    pa, pb, pc = (codec.encode(t, seed=0) for t in (a, b, c))
    pb_row = codec.encode(b[1], seed=0)  # a view of the matched storage
    assert pa.nbytes > 0 and pb.nbytes == 0 and pb_row.nbytes == 0
    assert pc.nbytes > 0  # the exact check rejects a fingerprint collision
    assert torch.equal(codec.decode(pb), b) and torch.equal(codec.decode(pc), c)
    assert torch.equal(codec.decode(pb_row), b[1]) and torch.equal(codec.decode(pa), a)
