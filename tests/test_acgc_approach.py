"""acgc loosens its global budget only as far as the layers' errors through δ allow
(lightning_acgc/policies/acgc_approach.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_acgc.policies import ACGCPolicy
from lightning_acgc.policies.acgc_approach import delta_reading, held_budget, next_limit
from tests.test_policies import _train


def test_the_limit_grows_by_the_room_the_worst_layer_leaves() -> None:
    assert next_limit(1.0, {"q": 0.25, "k": 0.5, "fc": 0.1}) == pytest.approx(2.0)
    assert next_limit(1.0, {"q": 3.0}) == 1.0  # over its share: no loosening (floors act)
    assert next_limit(None, {"q": 0.5}) is None  # nothing allocated yet: no limit
    assert held_budget(3.0, 2.0) == (2.0, 1.5)  # held 1.5x, the own budgets lifted by it
    assert held_budget(1.5, 2.0) == (1.5, 1.0)


def test_the_delta_reading_counts_the_room_the_own_input_leaves() -> None:
    # own input unused: the whole budget is δ's room
    assert delta_reading(0.3, 0.0, 1.0, 0.8) == pytest.approx(0.3)
    # own input at its share (0.8): δ reads against the fifth left
    assert delta_reading(0.9, 0.8, 1.0, 0.8) == pytest.approx(0.5)
    # own input over its share: still the fifth, never less
    assert delta_reading(1.0, 0.95, 1.0, 0.8) == pytest.approx(0.25)
    # an error the own input explains reads 0
    assert delta_reading(0.2, 0.4, 1.0, 0.8) == 0.0
    # the same error through δ (0.1) reads more where the own input takes more
    assert delta_reading(0.5, 0.4, 1.0, 0.8) > delta_reading(0.2, 0.1, 1.0, 0.8)


class _Recording(ACGCPolicy):
    """Notes, at each allocation, the aim/κ the model asks for, the limit in force and
    what the allocation took."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.allocations: list[tuple[float, float | None, float]] = []

    def _allocate(self) -> None:
        asked, limit = self.aim / self.kappa, self._approach
        super()._allocate()
        self.allocations.append((asked, limit, self._approach_used))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).mean(1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 12, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def test_allocations_stay_within_the_limit_their_layers_set() -> None:
    """Each allocation after a verified calibration takes at most the limit that
    calibration's layers set (and less than κ asked for where it binds); the limit
    survives a checkpoint."""
    policy = _Recording(gradient_error=0.05, calibrate_every=1)
    _, history = _train(_Attention(), policy, 6, _batch, lr=0.05)
    allocations = policy.allocations
    assert len(allocations) >= 5 and allocations[0][1] is None
    for asked, limit, took in allocations:
        assert took == pytest.approx(asked if limit is None else min(asked, limit))
    bound = [(asked, limit) for asked, limit, _ in allocations if limit and asked > limit]
    assert bound, allocations  # κ's first falls ask for more than the layers allow
    assert max(h.get("budget_held", 1.0) for h in history) > 1.0  # logged
    resumed = ACGCPolicy()
    resumed.load_state_dict(policy.state_dict())
    assert (resumed._approach, resumed._approach_used) == (
        policy._approach,
        policy._approach_used,
    )
