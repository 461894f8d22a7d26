"""acgc's joint allocation: every module's budget met by all the tensors that reach it."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_acgc.policies.acgc_allocation import _element_shares, quant_allocation
from lightning_acgc.policies.acgc_joint import joint_min_widths, module_loads
from lightning_acgc.policies.bit_allocation import KEEP, LADDER

ORDER = (*LADDER, KEEP)


def _table(scale: float) -> dict[int, float]:
    """Per-element variance at each width (about 4x per bit)."""
    return {b: scale / (2**b - 1) ** 2 for b in LADDER}


def _within(loads: dict[str, float], budgets: dict[str, float]) -> bool:
    return all(loads[m] <= budgets[m] * (1 + 1e-9) for m in loads)


@pytest.mark.parametrize("seed", range(20))
def test_every_budget_holds_and_no_tensor_goes_below_its_minimum(seed: int) -> None:
    """Random tensors reaching random modules (factors over six decades): the widths meet
    every module's budget, respect the minimum widths, and no single tensor can step
    down a width without breaking a budget it reaches."""
    rng = random.Random(seed)
    modules = [f"m{j}" for j in range(6)]
    n = 25
    sizes = [rng.choice([10, 1000, 50_000]) for _ in range(n)]
    factors = [
        {m: 10 ** rng.uniform(-3, 3) for m in rng.sample(modules, rng.randint(0, 4))}
        for _ in range(n)
    ]
    tables = [_table(10 ** rng.uniform(-4, 1)) for _ in range(n)]
    mins = [rng.choice([1, 1, 1, 3, 6, 16]) for _ in range(n)]
    budgets = {m: 10 ** rng.uniform(-6, 0) for m in modules}
    widths = joint_min_widths(sizes, factors, tables, budgets, mins, [32] * n, 0.125)
    loads = module_loads(factors, tables, widths)
    assert _within(loads, budgets)
    assert all(ORDER.index(w) >= ORDER.index(lo) for w, lo in zip(widths, mins, strict=True))
    for i, w in enumerate(widths):
        if w == mins[i] or not sizes[i]:
            continue
        lower = ORDER[ORDER.index(w) - 1]
        trial = [*widths[:i], lower, *widths[i + 1 :]]
        assert not _within(module_loads(factors, tables, trial), budgets), (i, w, lower)


def test_tensors_that_fit_together_at_8_bits_are_not_sent_to_16() -> None:
    """BERT-base's case: Q and V each take a quarter of their query projection's budget at
    8 bits, and 20 larger tensors reach it too (each a tenth of it at 1 bit, a ninth of that
    at 2). Split by elements beforehand, Q's and V's parts were a few percent each: both
    went to float16 (16 bits). Met jointly, they stay at 8 bits at most and the large
    tensors take the bit that is cheap for them."""
    budgets = {"query": 1.0}
    qv = _table(1.0)
    scale = 0.25 / qv[8]
    big = _table(0.1 / 20)
    sizes = [400_000, 400_000] + [800_000] * 20
    factors = [{"query": scale}] * 2 + [{"query": 20.0}] * 20
    tables = [qv, qv] + [big] * 20
    widths = joint_min_widths(sizes, factors, tables, budgets, [1] * 22, [32] * 22, 0.125)
    assert widths[0] <= 8 and widths[1] <= 8
    assert _within(module_loads(factors, tables, widths), budgets)
    # the same through quant_allocation, with and without the per-module split beforehand
    sens = {f"t{i}": (sizes[i], factors[i], 0.0) for i in range(22)}
    variances = {f"t{i}": [tables[i][b] for b in LADDER] for i in range(22)}
    args = ({"query": 4.0}, 1e12, 0.5, lambda k: 1.0, lambda m: 1.0, 0.5, {}, 0.125)
    joint, _ = quant_allocation(sens, variances, *args)
    assert joint["t0"] <= 8 and joint["t1"] <= 8
    # split beforehand (by elements), Q's part is under its load at 8 bits
    parts = _element_shares(sens, budgets)
    assert factors[0]["query"] * qv[8] > 4 * parts["t0"]["query"]


def test_the_joint_widths_are_the_cheapest_on_small_cases() -> None:
    """Against every combination of widths up to 8 bits, for three tensors of different
    sizes on two modules: the greedy's bits are the fewest that meet both budgets."""
    v = {b: 4.0**-b for b in LADDER}
    sizes, factors = [10, 1000, 300], [{"a": 1.0}, {"a": 1.0, "b": 2.0}, {"b": 1.0}]
    budgets = {"a": 4.0**-4, "b": 3 * 4.0**-5}
    widths = joint_min_widths(sizes, factors, [v] * 3, budgets, [1] * 3, [32] * 3)
    best = min(
        sum(n * b for n, b in zip(sizes, combo, strict=True))
        for combo in itertools.product(range(1, 9), repeat=3)
        if _within(module_loads(factors, [v] * 3, list(combo)), budgets)
    )
    assert sum(n * b for n, b in zip(sizes, widths, strict=True)) == best


def test_a_tensor_reaching_no_budgeted_module_stays_at_its_minimum() -> None:
    widths = joint_min_widths([100, 100], [{}, {"m": 1.0}], [_table(1.0)] * 2, {"m": 1e-6},
                              [3, 1], [32, 32])  # fmt: skip
    assert widths[0] == 3 and widths[1] > 1
