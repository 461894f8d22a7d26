"""The meter counts by storage: reported saved bytes equal the distinct storages a plain
``saved_tensors_hooks`` pass sees, on several architectures; identity is exactly 1.00x;
no ratio passes the codec's ceiling; a packed form not smaller than the tensor is not
used; the per-site table is short by default and says why tensors stayed raw."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _lightning_models import TinyCNN, fit
from torch import nn

from lightning_acgc import ActivationCompression, compress_activations


class CNNMaxPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ViTBlock(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.block = nn.TransformerEncoderLayer(
            dim, 4, 4 * dim, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
        )
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1)
        return self.head(self.block(h)[:, 0])


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cell(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class GNNLayer(nn.Module):
    """Mean aggregation with index_add and scatter_add, no torch_geometric."""

    def __init__(self, dim: int = 32, nodes: int = 200, edges: int = 1200) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("edge_index", torch.randint(0, nodes, (2, edges), generator=g))
        self.msg = nn.Linear(dim, dim)
        self.upd = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, dst = self.edge_index
        m = F.relu(self.msg(x))[src]
        agg = torch.zeros_like(x).index_add(0, dst, m)
        idx = dst.unsqueeze(1).expand(-1, x.shape[1])
        mx = torch.zeros_like(x).scatter_add(0, idx, m * torch.sigmoid(m))
        h = F.relu(self.upd(torch.cat([agg + mx, x], dim=1)))
        return self.head(h)


def _cases() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], bool]]:
    g = torch.Generator().manual_seed(1)
    return {
        "cnn_maxpool": (CNNMaxPool, lambda: torch.randn(8, 3, 16, 16, generator=g), False),
        "vit_block": (ViTBlock, lambda: torch.randn(4, 3, 32, 32, generator=g), False),
        "gru": (lambda: Recurrent(nn.GRU), lambda: torch.randn(4, 12, 32, generator=g), False),
        "lstm": (lambda: Recurrent(nn.LSTM), lambda: torch.randn(4, 12, 32, generator=g), False),
        "gnn": (GNNLayer, lambda: torch.randn(200, 32, generator=g), False),
        "cnn_bf16_autocast": (
            CNNMaxPool, lambda: torch.randn(8, 3, 16, 16, generator=g), True
        ),
    }  # fmt: skip


CASES = _cases()


def _autocast(on: bool):
    if on:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def distinct_saved_bytes(model: nn.Module, x: torch.Tensor, bf16: bool) -> int:
    """The reference: bytes of the distinct storages autograd saves in a plain pass
    (parameters and buffers excluded: they are resident anyway)."""
    resident = {
        t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())
    }
    storages: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.layout == torch.strided and ptr not in resident:
            storages[ptr] = t  # held, as autograd holds it: no address is reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(bf16):
        loss = model(x).float().square().mean()
    loss.backward()
    return sum(t.untyped_storage().nbytes() for t in storages.values())


def _metered(model: nn.Module, x: torch.Tensor, bf16: bool, **options: object):
    with compress_activations(model=model, **options) as stats, _autocast(bf16):
        loss = model(x).float().square().mean()
    loss.backward()
    return stats


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_are_the_distinct_storages_autograd_holds(name: str) -> None:
    make, data, bf16 = CASES[name]
    torch.manual_seed(0)
    model, x = make(), data()
    reference = distinct_saved_bytes(model, x, bf16)
    assert reference > 0
    identity = _metered(model, x, bf16, codec="identity")
    assert identity.saved_bytes == pytest.approx(reference, rel=0.01)
    assert identity.packed_bytes == identity.saved_bytes  # exactly 1.00x
    assert identity.ratio == identity.codec_ratio == 1.0
    quant = _metered(model, x, bf16, codec="quant", bits=2, min_numel=0)
    assert quant.saved_bytes == pytest.approx(reference, rel=0.01)
    # 2 bits of a 16/32-bit float at most; integer sites (max-pool indices) are packed
    # losslessly, against their window down to 2 bits of 64, so only floats are bounded
    ceiling = (16 if bf16 else 32) / 2
    floats = [r for r in quant.sites.values() if r.codec == "quant" and r.shared_with is None]
    assert floats
    raw, packed = sum(r.tensor_bytes for r in floats), sum(r.packed_bytes for r in floats)
    assert 1.0 < raw / packed <= ceiling
    assert quant.codec_ratio > 1.0
    assert quant.ratio > 1.0
    for rec in quant.sites.values():
        assert rec.packed_bytes <= rec.tensor_bytes
        if rec.codec == "quant":  # (integer sites: lossless intpack, its own ceiling)
            assert rec.ratio <= ceiling


def test_a_packed_form_not_smaller_is_not_used() -> None:
    """8-bit quant of a tiny bf16 tensor with group metadata is larger than the tensor."""
    x = torch.randn(2, 4, requires_grad=True, dtype=torch.bfloat16) * 1.0
    settings = {"min_numel": 0, "compress_loss": True}  # sin() runs outside any module
    with compress_activations(codec="quant", bits=8, group_size=8, **settings) as stats:
        y = x.sin()
    y.float().sum().backward()
    (rec,) = stats.sites.values()
    assert rec.codec == "kept" and rec.settings == "quant not smaller"
    assert rec.packed_bytes == rec.raw_bytes == x.numel() * 2
    assert stats.tensors_packed == 0 and stats.ratio == 1.0


def test_table_is_short_by_default_and_names_why_tensors_stayed_raw() -> None:
    make, data, _ = CASES["cnn_maxpool"]
    model = make()
    stats = _metered(model, data(), False, codec="quant", bits=4, min_numel=2048)
    short, full = stats.table(), stats.table(full=True)
    assert len(stats.sites) > 8
    assert len(short.splitlines()) < len(full.splitlines())
    assert short.splitlines()[-1].startswith("total") and full.splitlines()[-1].startswith("total")
    assert "kept raw:" in short  # the reasons, counted, also in the short table
    assert "tiny" in short  # the small tensors, below min_numel
    assert "intpack" in full  # max-pool indices, packed losslessly


def test_callback_prints_the_full_table_on_request(tmp_path: Path) -> None:
    tables = {}
    for mode in (True, "full"):
        cb = ActivationCompression(codec="quant", bits=4, min_numel=0, print_table=mode)
        model = TinyCNN(batch_size=4, samples=8)
        model.net.insert(6, nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()))
        fit(model, [cb], max_steps=1, default_root_dir=str(tmp_path))
        tables[mode] = cb.summary()
        assert cb.stats is not None and len(cb.stats.sites) > 10
    assert "smaller sites (print_table='full'" in tables[True]
    assert "smaller sites" not in tables["full"]
    with pytest.raises(ValueError, match="print_table"):
        ActivationCompression(print_table="some")
