"""The error model of a training-mode BatchNorm's saved input (policies/batch_norm_path.py):
its factors against the gradient error measured with noise in that input alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_acgc.engine.meter import SiteRecord
from lightning_acgc.policies.acgc_floors import MASK_FLOOR
from lightning_acgc.policies.batch_norm_path import BatchNormPaths, alignment
from lightning_acgc.policies.error_model import batch_norm_entries, tensor_sensitivities
from lightning_acgc.policies.gradient_stats import GradientStats


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1, bias=False)]
    for _ in range(3):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False)]
    layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)]
    return nn.Sequential(*layers)


def _weight_ops(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, noisy=None) -> dict:
    """Weight-op gradients; ``noisy=(bn, noise)``: the BatchNorm's saved input plus noise."""
    model.zero_grad(set_to_none=True)
    inside = [False]
    handles = []
    if noisy is not None:
        bn = dict(model.named_modules())[noisy[0]]
        handles = [
            bn.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True)),
            bn.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False)),
        ]

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t + noisy[1] if inside[0] and t.shape == noisy[1].shape else t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for h in handles:
        h.remove()
    named = dict(model.named_modules())
    return {m: named[m].weight.grad.clone() for m in _weight_ops(model)}


def _tables(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    stats = GradientStats()
    stats.batch_norm = BatchNormPaths()
    stats.setup(model)
    stats.start()
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    grad_sq = stats.stop()
    grads = {f"{n}.{k}": p.grad for n, m in model.named_modules()
             for k, p in m.named_parameters(recurse=False)}  # fmt: skip
    return stats, stats.batch_norm_tables(grads, None), grad_sq


@pytest.mark.parametrize("bn", ["1", "4", "7", "10"])
def test_modelled_error_of_a_batch_norm_input_follows_the_measured(bn: str) -> None:
    """Noise of mean variance v (channel c: v·var_c / mean var) in one BatchNorm's saved
    input, nothing else: the weight ops' summed gradient error is the model's Σ_m c_m·v
    within 4x either way (the old heuristic was 0.002-300x off on ResNet-50)."""
    model = _net()
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    stats, tables, grad_sq = _tables(model, x, y)
    entries = batch_norm_entries(tables[bn], tables, stats.fan_in, grad_sq)
    exact = _grads(model, x, y)
    inputs: dict = {}
    named = dict(model.named_modules())
    handle = named[bn].register_forward_pre_hook(lambda m, a: inputs.setdefault("x", a[0]))
    _grads(model, x, y)
    handle.remove()
    xin = inputs["x"].detach()
    var = xin.transpose(0, 1).reshape(8, -1).var(1, unbiased=False)
    v = 1e-4 * float(var.mean())
    measured = dict.fromkeys(exact, 0.0)
    for seed in range(4):
        torch.manual_seed(seed)
        noise = torch.randn_like(xin) * (v * var / var.mean()).sqrt().view(1, -1, 1, 1)
        noisy = _grads(model, x, y, (bn, noise))
        for m in exact:
            measured[m] += float((noisy[m] - exact[m]).square().sum()) / 4
    modelled = sum(entries.values()) * v
    assert 0.25 < modelled / sum(measured.values()) < 4, (modelled, measured)
    # the first conv, furthest up: reached through δ alone (not the making op's part)
    assert 0.1 < entries["0"] * v / measured["0"] < 10


def test_entries_reach_every_weight_op_before_the_batch_norm_and_none_after() -> None:
    model = _net()
    stats, tables, grad_sq = _tables(model, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    entries = batch_norm_entries(tables["7"], tables, stats.fan_in, grad_sq)
    assert sorted(entries) == ["0", "3", "6"]
    assert all(c > 0 for c in entries.values())
    assert set(tables) == {"0", "3", "6", "9", "13", "1", "4", "7", "10"}


def test_a_batch_norm_called_twice_or_in_eval_mode_is_not_used() -> None:
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    model = nn.ModuleDict({"conv": conv, "bn": bn})
    paths = BatchNormPaths()
    paths.setup(model, {"conv": 27})
    for twice, train in ((True, True), (False, False)):
        model.train(train)
        paths.start()
        h = conv(torch.randn(4, 3, 6, 6))
        out = bn(h)
        if twice:  # one BatchNorm on two inputs in one pass
            out = out + bn(h * 2)
        out.square().sum().backward()
        paths.stop()
        grads = {"bn.weight": torch.ones(4)}
        assert paths.tables(grads).get("bn", {}).get("usable", 0.0) == 0.0


def test_hooks_exist_only_between_start_and_stop() -> None:
    model = _net()
    paths = BatchNormPaths()
    paths.setup(model, set(_weight_ops(model)))

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    paths.start()
    assert hooks() > 0
    paths.stop()
    assert hooks() == 0


def test_alignment_of_a_linear_layer_matches_its_definition() -> None:
    torch.manual_seed(0)
    fc = nn.Linear(5, 3)
    inp = torch.randn(32, 5)
    x = fc(inp).detach()
    var, mean = torch.var_mean(x, 0, unbiased=False)
    xh = (x - mean) / var.sqrt()
    direct = (xh.t() @ inp / 32).square().sum(1)  # ‖mean(x̂_c · input)‖²
    torch.testing.assert_close(alignment(fc, inp, x, mean, var), direct)
    assert alignment(nn.ReLU(), inp, x, mean, var) is None


def _rec(key: str, module: str, mtype: str, **kw) -> SiteRecord:
    return SiteRecord(key, module, mtype, (4, 8), "float32", "quant", "bits=4", **kw)


def test_a_relu_site_adds_no_error_where_the_mask_is_kept() -> None:
    """The ReLU's own save of its output reads only the mask (quant keeps it from 2 bits):
    no factor of its own; the Linear that shares it counts as before; the tensor gets
    ``keeps_mask`` (a floor of 2 bits), and is 'exact' only where nothing else saved it."""
    records = {
        "relu:0": _rec("relu:0", "relu", "ReLU"),
        "fc:0": _rec("fc:0", "fc", "Linear", shared_with="relu:0"),
        "last:0": _rec("last:0", "last", "ReLU"),
    }
    grad_sq = {"relu": 3.0, "fc": 2.0, "last": 5.0}
    on = tensor_sensitivities(records, grad_sq, {"fc": 4}, exact_masks=True)
    off = tensor_sensitivities(records, grad_sq, {"fc": 4})
    assert on["relu:0"].other == 0 and off["relu:0"].other > 0
    assert on["relu:0"].weight == off["relu:0"].weight == 8.0
    assert on["relu:0"].keeps_mask and not on["relu:0"].mask_only
    assert on["last:0"].keeps_mask and on["last:0"].mask_only and on["last:0"].total == 0
    assert not off["last:0"].keeps_mask and off["last:0"].total > 0
    assert MASK_FLOOR == 2


def test_only_the_last_forward_pass_is_read() -> None:
    """A noise budget's batch halves run before the exact pass, under the same hooks: the
    readings are the last pass's (the first module run again starts a new one)."""
    model = _net()
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    _, once, _ = _tables(model, x, y)
    paths = BatchNormPaths()
    paths.setup(model, set(_weight_ops(model)))
    paths.start()
    for part in (x[:8], x[8:], x):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(part), y[: part.shape[0]]).backward()
    paths.stop()
    grads = {f"{n}.{k}": p.grad for n, m in model.named_modules()
             for k, p in m.named_parameters(recurse=False)}  # fmt: skip
    last = paths.tables(grads)
    for bn in ("1", "4", "7", "10"):
        assert last[bn]["usable"] == 1.0
        assert last[bn]["propagated"] == pytest.approx(once[bn]["propagated"], rel=1e-4)
