"""Tensors saved inside a parameter-free elementwise module (GPT-2's NewGELU written op by
op), and its output, remade at unpack by running the module again on its decoded input
(lightning_acgc.engine.replay), for policies that set ``derives_elementwise`` (acgc)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_acgc import compress_activations
from lightning_acgc.codecs.spec import CodecSpec
from lightning_acgc.engine import ActivationCompressor
from lightning_acgc.engine.replay import replay
from tests.test_derive import Deriving, Mlp, _grads, _inputs, derived_matches_plain


class NewGelu(nn.Module):
    """Hugging Face's ``NewGELUActivation``: four tensors of its input's size saved."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NewGelu.calls += 1
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class RandomGate(nn.Module):
    """Smooth ops around a random mask: run again, it draws another."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.pow(x, 2.0) * (torch.rand_like(x) > 0.5))


class Clamped(nn.Module):
    """A jump (the clamp's mask) between the input and what it saves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x).clamp(0.2, 0.8)


class BufferedTanh(nn.Module):
    """A buffer (which a forward may update, as BatchNorm's running statistics): not a
    module the engine runs again."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(self.scale * x)


class RMSNorm(nn.Module):
    """Llama's RMSNorm written out: its 1/rms per row kept as a norm statistic, its
    normalized input and its output (weight · it) remade from its input."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * (x * rstd)


class Measuring(Deriving):
    measuring = False  # not measuring: sites checked at first sight only


def _remade(stats) -> dict[str, str]:
    return {k: r.settings for k, r in stats.sites.items() if "run again" in r.settings}


def test_saves_and_output_are_remade_and_give_plain_gradients():
    torch.manual_seed(0)
    stats = derived_matches_plain(Mlp(NewGelu()), _inputs())
    settings = _remade(stats)
    # the tanh, 0.5·x and 1 + tanh inside; the output, saved by the second Linear
    assert sorted(settings) == ["act:1", "act:2", "act:3", "b:0"]
    assert settings["b:0"] == "NewGelu run again (output) of act:0"
    for key in settings:
        rec = stats.sites[key]
        assert rec.codec == "recomputed" and rec.packed_bytes == 0
        assert rec.derived_from == "act:0" and 0 < rec.gain < 2


def _node(t: torch.Tensor, kind: str):
    stack = [t.grad_fn]
    while stack:
        node = stack.pop()
        if type(node).__name__ == kind:
            return node
        stack.extend(n for n, _ in node.next_functions if n is not None)
    raise AssertionError(kind)


def test_remade_from_the_decoded_input():
    torch.manual_seed(0)
    model, x = Mlp(NewGelu()), _inputs(1)
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 4}))):
        out = model(x)
    x_hat = _node(out, "PowBackward0")._saved_self  # the input, decoded
    assert not torch.equal(x_hat, model.a(x).detach())  # rounded at 4 bits
    saves, y = replay(model.act, x_hat, ("cpu", False, torch.bfloat16))
    torch.testing.assert_close(_node(out, "AddmmBackward0")._saved_mat1, y.reshape(-1, 64))
    torch.testing.assert_close(_node(out, "TanhBackward0")._saved_result, saves[1])


@pytest.mark.parametrize("act", [RandomGate(), Clamped(), BufferedTanh()], ids=type)
def test_what_cannot_be_run_again_is_packed(act):
    """A random draw fails the check (and leaves the draws after it as plain's), a jump
    or a buffer is not tried; the gradients stay plain's."""
    torch.manual_seed(0)
    model, x = Mlp(act), _inputs()
    torch.manual_seed(1)
    plain, _ = _grads(model, x)
    after_plain = torch.rand(3)
    torch.manual_seed(1)
    kept, stats = _grads(model, x, Deriving(None))
    assert not _remade(stats)
    torch.testing.assert_close(torch.rand(3), after_plain, rtol=0, atol=0)
    for a, b in zip(kept, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("policy", [Measuring, Deriving])
def test_one_run_per_call_at_unpack(policy):
    """The module runs once more to check its first call (and, on a step that
    measures, every call, and twice for the gains of all its tensors), then once per
    call in backward, shared by the four tensors remade from it."""
    torch.manual_seed(0)
    model, x = Mlp(NewGelu()), _inputs()
    engine = ActivationCompressor(policy(CodecSpec("quant", {"bits": 8})), model=model)
    engine.install()
    runs = []
    try:
        for _ in range(2):
            NewGelu.calls = 0
            engine.new_step()
            with engine.scope():
                loss = model(x).square().mean()
            loss.backward()
            runs.append(NewGelu.calls)
    finally:
        engine.remove()
    # step 1: forward, the check, backward's; step 2: forward and backward's (the
    # verdicts kept); measuring: forward, the check, two for the gains, backward's
    assert runs == ([5, 5] if policy.measuring else [3, 2])


def test_remade_under_autocast_as_it_ran():
    torch.manual_seed(0)
    stats = derived_matches_plain(Mlp(NewGelu()), _inputs(2), autocast=True)
    assert "b:0" in _remade(stats)


def test_a_norm_written_out_is_remade_with_its_parameter_and_statistics_kept():
    """Llama's RMSNorm: the normalized input (saved for the weight's gradient) and the
    output (saved by the next Linear) remade from the input; the 1/rms per row is not
    (smaller than the input: kept as a norm statistic); plain's gradients bit for bit;
    the gains ‖f(x + δ) − f(x)‖²/‖δ‖², about mean(1/rms²)·(1 − 1/16) (a change along a
    row's own direction is normalized away), times mean(weight²) for the output."""
    torch.manual_seed(0)
    model, x = Mlp(nn.Identity()), _inputs(3)
    model.norm = RMSNorm()
    stats = derived_matches_plain(model, x)
    settings = _remade(stats)
    assert settings == {"norm:4": "RMSNorm run again (save 4) of norm:0",
                        "a:0": "RMSNorm run again (output) of norm:0"}  # fmt: skip
    h = x.detach() * 1.0
    rstd2 = 1 / (h.square().mean(-1) + 1e-6)
    w2 = model.norm.weight.detach().square().mean()
    expected = float(rstd2.mean()) * (1 - 1 / 16)
    assert stats.sites["norm:4"].gain == pytest.approx(expected, rel=0.1)
    assert stats.sites["a:0"].gain == pytest.approx(expected * float(w2), rel=0.1)


def test_a_parameter_changed_in_place_before_backward_is_an_error():
    torch.manual_seed(0)
    model, x = Mlp(nn.Identity()), _inputs()
    model.norm = RMSNorm()
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 8}))):
        loss = model(x).square().mean()
    with torch.no_grad():
        model.norm.weight.mul_(2)
    with pytest.raises(RuntimeError, match="a parameter of RMSNorm was modified in place"):
        loss.backward()


def test_autocast_s_copy_of_the_output_is_the_output_run_again_and_cast():
    """Under bf16 autocast the Linear after a float32 norm saves its own bf16 copy of the
    norm's output: remade as the output run again, cast as autocast cast it."""
    torch.manual_seed(0)
    model, x = Mlp(nn.Identity()), _inputs(4)
    model.norm = RMSNorm()
    stats = derived_matches_plain(model, x, autocast=True)
    assert stats.sites["a:0"].dtype == "bfloat16"  # (a:1: the weight's bf16 copy)
    assert _remade(stats)["a:0"] == "RMSNorm run again (output, bfloat16) of norm:0"


class Switch(nn.Module):
    """Saves other tensors once ``wide`` is off (as a forward that branches on its
    input's values may on the decoded input)."""

    wide = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(torch.pow(x, 2.0)) * (0.5 * x)
        return y if Switch.wide else y[..., :8]


def test_a_replay_that_saves_other_tensors_is_an_error_not_a_wrong_gradient():
    torch.manual_seed(0)
    model, x = Mlp(Switch()), _inputs()
    with compress_activations(model=model, policy=Deriving(CodecSpec("quant", {"bits": 8}))):
        loss = model(x).square().mean()
    Switch.wide = False
    try:
        with pytest.raises(RuntimeError, match="Switch run again on its decoded input saved"):
            loss.backward()
    finally:
        Switch.wide = True
