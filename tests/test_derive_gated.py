"""A gated unit's product ``a·b`` (SwiGLU: ``silu(gate(x))·up(x)``), saved by the next
Linear, remade from its two factors' holders (lightning_acgc.engine.derive_gated), for
policies that set ``derives_elementwise`` (acgc)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine.derive_gated import gated_output
from lightning_acgc.engine.derive_graph import Origin
from tests.test_derive import Deriving, _inputs, derived_matches_plain


class SwiGlu(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0  # not a leaf: saved, and rounded, by the projections
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _product_record(stats):
    (rec,) = [r for r in stats.sites.values() if r.settings.startswith("product of")]
    return rec


def test_the_product_is_remade_and_gives_plain_gradients():
    torch.manual_seed(0)
    model, x = SwiGlu(), _inputs()
    stats = derived_matches_plain(model, x)
    rec = _product_record(stats)
    assert rec.key == "down:0" and rec.codec == "recomputed" and rec.packed_bytes == 0
    # the gains: mean(up²) for the SiLU's rounding, mean(silu²) for the up projection's
    with torch.no_grad():
        a, b = F.silu(model.gate(x)), model.up(x)
    gains = dict([(rec.derived_from, rec.gain), *rec.also_from])
    assert sorted(gains.values()) == pytest.approx(
        sorted([float(b.square().mean()), float(a.square().mean())]), rel=1e-4
    )


def test_the_product_is_made_of_what_its_factors_unpack():
    torch.manual_seed(0)
    model, x = SwiGlu(), _inputs(1)
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 4}))):
        out = model(x)
    down = out.grad_fn
    while type(down).__name__ != "AddmmBackward0":
        down = down.next_functions[0][0]
    node = down.next_functions[1][0]
    while type(node).__name__ != "MulBackward0":
        node = node.next_functions[0][0]
    a_hat, b_hat = node._saved_self, node._saved_other
    assert not torch.equal(b_hat, model.up(x).detach())  # rounded at 4 bits
    torch.testing.assert_close(down._saved_mat1, (a_hat * b_hat).reshape(-1, 40), rtol=0, atol=0)


def test_a_square_has_one_holder_and_a_factor_not_saved_none():
    x = torch.randn(4, 8, requires_grad=True)
    a = torch.tanh(x)
    plan = gated_output(a * a, a * a, [Origin.of(a)])
    assert plan is not None and plan.sources == (0,)
    assert plan.gain(a.detach()) == pytest.approx(4 * float(a.detach().square().mean()))
    b = x * 3
    assert gated_output(a * b, a * b, [Origin.of(a)]) is None
    w = torch.randn(4, 8, requires_grad=True)  # a parameter as a factor
    assert gated_output(a * w, a * w, [Origin.of(a), Origin.of(w)]) is None
