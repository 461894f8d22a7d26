"""acgc's sensitivity probes: one more pass per class of tensors the error model guesses,
its measured error per module put on the class's nearest tensor."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_acgc import ActivationCompression
from lightning_acgc.engine import ActivationCompressor, EngineSettings, compressed_step
from lightning_acgc.policies import ACGCPolicy, build_policy
from lightning_acgc.policies.acgc_allocation import quant_allocation
from lightning_acgc.policies.acgc_probes import PROBE_WIDTH, PROBED_SHARE, tensor_class
from lightning_acgc.policies.bit_allocation import LADDER
from tests._lightning_models import fit


def test_probes_default_to_the_saturating_modules_and_probes_0_turns_them_off() -> None:
    """By default up to 8 classes a calibration, of the modules that saved a saturating
    activation's output (README's sweep table); ``probes=0`` runs none."""
    policy = _two_blocks()
    policy._calibrating, policy._exact = True, {}
    assert (policy.max_probes, policy.probe_scope) == (8, "saturating")
    assert policy.probe_classes(1) == ["enc.*.attn:0"]
    off = _two_blocks(probes=0)
    off._calibrating, off._exact = True, {}
    assert off.probe_classes(1) == []


def test_probe_scope_saturating_keeps_the_modules_that_saved_a_saturating_output() -> None:
    """A guessed tensor of a module with no softmax, tanh or sigmoid output (a LayerNorm's
    input here) is probed with ``probe_scope="all"`` only."""
    for scope, expected in (
        ("saturating", ["enc.*.attn:0"]),
        ("all", ["enc.*.attn:0", "enc.*.ln:0"]),
    ):
        policy = _two_blocks(probe_scope=scope)
        for block in (0, 1):
            policy._sens[f"enc.{block}.ln:0"] = deque([(500, {}, 5.0)])
            policy._variances[f"enc.{block}.ln:0"] = _table(1.0)
        policy._calibrating, policy._exact = True, {}
        assert policy.probe_classes(1) == expected, scope


def test_probes_option_sets_the_classes_per_calibration_and_rejects_bad_values() -> None:
    assert build_policy("acgc", probes=3).max_probes == 3
    assert build_policy("acgc").max_probes == 8
    assert ACGCPolicy.max_probes == 8  # the option sets the instance's, not the class's
    assert build_policy("acgc", probes=0).max_probes == 0 and ACGCPolicy.max_probes == 8
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"probes={bad!r} must be an int >= 0"):
            ACGCPolicy(probes=bad)
    assert build_policy("acgc", probe_scope="all").probe_scope == "all"
    with pytest.raises(ValueError, match="probe_scope='attention' is not allowed"):
        ACGCPolicy(probe_scope="attention")


def test_probes_and_target_options_from_the_hydra_config() -> None:
    from hydra.utils import instantiate

    from recipes.config_schema import compose_config

    overrides = ["compression=acgc", "compression.probes=4", "compression.probe_scope=all"]
    callback = instantiate(compose_config(overrides).compression)
    assert (callback.policy.max_probes, callback.policy.probe_scope) == (4, "all")
    assert callback.policy.target == 0.35  # null: the policy's own margin
    callback = instantiate(compose_config([*overrides, "compression.target=0.6"]).compression)
    assert callback.policy.target == 0.6


def _table(scale: float) -> list[float]:
    return [scale / (2**b - 1) ** 2 for b in LADDER]


def _two_blocks(**options) -> ACGCPolicy:
    """Tensor ``attn:0`` of blocks 0 and 1 (one class), modelled by the heuristic alone;
    each block's attention also saved a softmax output (``attn:1``)."""
    policy = ACGCPolicy(gradient_error=0.1, **options)
    for block in (0, 1):
        key = f"enc.{block}.attn:0"
        policy._sens[key] = deque([(1000, {}, 5.0)])
        policy._variances[key] = _table(1.0)
        policy._saturating.add(f"enc.{block}.attn:1")
    return policy


def test_a_probe_puts_each_module_error_on_the_nearest_tensor() -> None:
    """The query of block 0 moved by 4, that of block 1 by 9, the head (no nearer tensor
    than the other) by 1: each block's tensor gets its own query's error per unit of its
    variance, both share the head's; their heuristic other-op factor is dropped."""
    policy = _two_blocks()
    cls = "enc.*.attn:0"
    assert tensor_class("enc.1.attn:0") == cls
    policy._exact = {n: torch.zeros(2) for n in ("enc.0.q.weight", "enc.1.q.weight", "head.weight")}
    policy.begin_probe(cls)
    v = _table(1.0)[LADDER.index(PROBE_WIDTH)]
    policy._probe_var = {"enc.0.attn:0": v, "enc.1.attn:0": v}
    grads = {
        "enc.0.q.weight": torch.tensor([2.0, 0.0]),
        "enc.1.q.weight": torch.tensor([0.0, 3.0]),
        "head.weight": torch.tensor([1.0, 0.0]),
    }
    policy.end_probe(cls, grads)
    other = 5.0  # the heuristic factor at the probe: the readings are kept relative to it
    assert policy.probe_ratios("enc.0.attn:0") == pytest.approx(
        {"enc.0.q": 4 / v / other, "head": 1 / (2 * v) / other}
    )
    assert policy.probe_ratios("enc.1.attn:0") == pytest.approx(
        {"enc.1.q": 9 / v / other, "head": 1 / (2 * v) / other}
    )
    weights, left = policy.probed("enc.0.attn:0", {"enc.0.out": 2.0}, other)
    assert left == 0.0 and weights["enc.0.out"] == 2.0
    assert weights["enc.0.q"] == pytest.approx(4 / v)
    # the gradients shrank 100x since: so did the heuristic factor, and the measured ones
    assert policy.probed("enc.0.attn:0", {}, other / 100)[0]["enc.0.q"] == pytest.approx(
        4 / v / 100
    )
    assert policy.other_factor("enc.0.attn:0", {}, other) == pytest.approx(4 / v + 1 / (2 * v))
    assert set(policy.probe_floors()) == {"enc.0.attn:0", "enc.1.attn:0"}


def test_a_probe_that_measures_nothing_leaves_the_model_as_it_was() -> None:
    """Rounding that never reaches the gradient (a dropout mask: two levels, exact at any
    width) measures 0: the variance table already says so, the model stays."""
    policy = _two_blocks()
    policy._exact = {"enc.0.q.weight": torch.zeros(2)}
    policy.begin_probe("enc.*.attn:0")
    policy._probe_var = {"enc.0.attn:0": 0.1}
    policy.end_probe("enc.*.attn:0", {"enc.0.q.weight": torch.zeros(2)})
    assert policy.probed("enc.0.attn:0", {}, 5.0) == ({}, 5.0)


def test_the_probed_tensor_that_reaches_nothing_gets_fewer_bits() -> None:
    """Two tensors the heuristic rates alike; the probe finds one 1000x less sensitive.
    The allocation gives it fewer bits (and not fewer than the probe's width)."""
    policy = _two_blocks()
    policy._probe_readings["enc.0.attn:0"] = deque([{"enc.0.q": 1e-3}])
    policy._probe_readings["enc.1.attn:0"] = deque([{"enc.1.q": 1.0}])
    sens = policy.probed_all({k: policy._sens[k][0] for k in policy._sens})
    layer_sq = {"enc.0.q": 1.0, "enc.1.q": 1.0}
    widths, _ = quant_allocation(
        sens, policy._variances, layer_sq, 2.0, 1e-3, lambda k: 1.0, lambda m: 1.0, 0.5,
        {}, 0.125, policy.floors(),
    )  # fmt: skip
    low, high = widths["enc.0.attn:0"], widths["enc.1.attn:0"]
    assert PROBE_WIDTH <= low < high


class _Attention(nn.Module):
    """Single-head attention written out, so that it saves q, k, the probabilities and v;
    with a learned temperature, so that the probabilities are stored (not remade from q
    and k: engine/derive_softmax.py) and probed."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.temperature = nn.Parameter(torch.tensor(d**-0.5))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2) * self.temperature
        return self.drop(scores.softmax(-1)) @ self.v(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), _Attention(32), nn.LayerNorm(32), _Attention(32), nn.Linear(32, 1)
    )


def test_probes_run_on_calibration_steps_and_leave_no_trace() -> None:
    """Probes run after the exact gradient of a calibration with sensitivities: the
    step's loss is the plain loss of the same batch (dropout draws the same masks), its
    site records are the compressed pass's alone, and the promise holds."""
    model = _model()
    policy = build_policy("acgc", gradient_error=0.1, calibrate_every=2)
    engine = ActivationCompressor(policy, model=model, settings=EngineSettings(min_numel=64))
    engine.install()
    policy.setup(model)
    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1))
    try:
        for step in range(5):
            torch.manual_seed(100 + step)
            plain = model(x).square().mean()
            torch.manual_seed(100 + step)
            model.zero_grad()
            loss = compressed_step(engine, model, lambda: model(x).square().mean(), step)
            metrics = policy.metrics()
            assert torch.equal(loss, plain)
            assert sum(r.raw_bytes for r in engine.stats.sites.values()) == engine.stats.saved_bytes
            if step in (1, 2):
                assert metrics["probes"] >= 1, (step, metrics)
            if "grad_error" in metrics:
                assert metrics["grad_error"] <= 0.1, (step, metrics)
    finally:
        engine.remove()
        policy.teardown()
    assert policy._probe_readings
    state = policy.state_dict()
    fresh = ACGCPolicy(gradient_error=0.1)
    fresh.load_state_dict(state)
    assert fresh.probe_ratios(next(iter(state["probe_readings"]))) is not None


def test_probes_that_do_not_fit_the_memory_budget_are_skipped() -> None:
    """A probe keeps the other classes' tensors uncompressed. Under a memory budget that
    the compressed pass fits and a probe does not (a batch raised into the freed memory),
    the probes are skipped with a warning; training goes on and the promise holds."""
    model = _model()
    policy = build_policy("acgc", gradient_error=0.1, calibrate_every=2)
    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1))
    engine = ActivationCompressor(
        policy, model=model, settings=EngineSettings(min_numel=64), memory_budget=26_000
    )
    engine.install()
    policy.setup(model)
    try:
        with pytest.warns(RuntimeWarning, match="probe did not fit in memory"):
            for step in range(5):
                model.zero_grad()
                compressed_step(engine, model, lambda: model(x).square().mean(), step)
                metrics = policy.metrics()
                assert "probes" not in metrics, (step, metrics)
                if "grad_error" in metrics:
                    assert metrics["grad_error"] <= 0.1, (step, metrics)
        assert engine.stats.saved_bytes > 26_000 > engine.stats.peak_live_bytes
    finally:
        engine.remove()
        policy.teardown()


class _AttentionModule(LightningModule):
    """:func:`_model` on fixed random sequences; records, per ``training_step`` call,
    whether it was a calibration re-run (an exact pass or a probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()
        self.calls: list[bool] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self.calls.append(getattr(self, "acgc_calibrating", False))
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 16, 8, generator=g), torch.randn(32, 16, generator=g))
        return DataLoader(data, batch_size=8)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_runs_the_probes_as_calibration_calls(accumulate: int) -> None:
    """Through the callback: the warm-up's second calibration probes every kind of
    guessed tensor (at most ``max_probes``), the third re-probes one; each probe is one
    more flagged call. With gradient accumulation the probes run on each step's last
    batch (the exact passes on every batch)."""
    model = _AttentionModule()
    cb = ActivationCompression("acgc", calibrate_every=100, min_numel=64, print_table=False)
    fit(model, [cb], max_steps=4, max_epochs=-1, accumulate_grad_batches=accumulate)
    classes = len(cb.policy._probed_at)
    assert 0 < classes <= cb.policy.max_probes  # all probed at step 1
    assert model.calls.count(False) == 4 * accumulate
    # the exact passes of steps 0-2; step 1 probes every kind, step 2 the oldest again
    assert model.calls.count(True) == 3 * accumulate + classes + cb.policy.probe_refresh
    assert cb.policy._probe_readings  # what the probes measured was read
    assert "acgc_calibrating" not in model.__dict__


def test_a_layer_budget_is_shared_by_every_tensor_that_reaches_it() -> None:
    """Probed factors put several tensors on one op's gradient (attention's Q, K, V and
    probabilities on its in-projection): together, not each, they stay within the op's
    budget (each held alone, the quick transformer's attention measured 2.95x it), and a
    tensor that reaches it faintly leaves its part to the others."""
    v = [1.0 / (2**b - 1) ** 2 for b in LADDER]
    layer_sq, e_sq, share = {"attn": 1.0}, 0.01, 0.5
    budget = share * e_sq * layer_sq["attn"]

    def widths(factors: dict[str, float]) -> dict[str, int]:
        sens = {k: (1000, {"attn": c}, 0.0) for k, c in factors.items()}
        variances = {k: v for k in factors}
        args = (layer_sq, 1e9, e_sq, lambda k: 1.0, lambda m: 1.0, share, {}, 0.0)
        return quant_allocation(sens, variances, *args)[0]

    def used(factors: dict[str, float], bits: dict[str, int]) -> float:
        return sum(c * v[LADDER.index(bits[k])] for k, c in factors.items())

    alone = widths({"q": 1.0})
    assert used({"q": 1.0}, alone) <= budget
    four = {"q": 1.0, "k": 1.0, "v": 1.0, "p": 1.0}
    together = widths(four)
    assert used(four, together) <= budget < 4 * used({"q": 1.0}, alone)
    assert all(together[k] > alone["q"] for k in four)
    faint = widths({"q": 1.0, "p": 1e-9})
    assert faint == {"q": alone["q"], "p": LADDER[0]}


def test_a_module_without_a_weight_op_is_held_to_its_own_budget() -> None:
    """MultiheadAttention's in-projection is a parameter of the attention module itself,
    not a weight op's: a probe finds Q, K, V reaching it, and its budget enters the
    allocation (it was measured per layer but never allocated for: 33x over)."""
    model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True))
    policy = ACGCPolicy()
    policy.setup(model)
    assert "0" not in policy._own_ops and "0.out_proj" in policy._own_ops
    assert set(policy._held_modules({"0": 2.0, "0.out_proj": 1.0})) == {"0", "0.out_proj"}


def test_layers_give_their_measured_tensors_more_of_their_budget_once_all_are_probed() -> None:
    """Until every class the model guesses has a probe reading, half of each layer's
    budget stays for errors reaching it through δ; once all have one, those errors are
    measured and in the layer's own budget: it may fill ``PROBED_SHARE`` of it."""
    policy = _two_blocks(probes=0)
    policy._probe_readings["enc.0.attn:0"] = deque([{"enc.0.q": 1.0}])
    assert policy.own_share() == policy.layer_share == 0.5  # probes off
    policy = _two_blocks()
    assert policy.own_share() == 0.5  # none probed yet
    policy._probe_readings["enc.0.attn:0"] = deque([{"enc.0.q": 1.0}])
    policy._probed_at["enc.*.attn:0"] = 1
    assert policy.own_share() == PROBED_SHARE > policy.layer_share
    policy._sens["dec.0.attn:0"] = deque([(1000, {}, 5.0)])  # a class not probed yet
    policy._variances["dec.0.attn:0"] = _table(1.0)
    policy._saturating.add("dec.0.attn:1")
    assert policy.own_share() == 0.5


def test_layers_use_the_probed_share_where_nothing_is_left_to_the_heuristic() -> None:
    """No tensor with a heuristic factor (a ResNet, its BatchNorm inputs modelled): each
    layer's own tensors may fill PROBED_SHARE of its budget; one guessed factor, and the
    rest of the budget is kept for it (``layer_share``)."""
    policy = ACGCPolicy()
    policy._sens = {"conv:0": deque([(64, {"conv": 1.0, "stem": 0.5}, 0.0)])}
    assert policy.own_share() == PROBED_SHARE
    policy._sens["act:0"] = deque([(64, {}, 2.0)])
    assert policy.own_share() == policy.layer_share < PROBED_SHARE
