"""Setting non-finite values aside so that NaN/inf survive any lossy codec exactly."""

from __future__ import annotations

import torch

__all__ = ["fill_nonfinite_rows", "restore_exceptions"]


def fill_nonfinite_rows(
    groups: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replace NaN/inf in a (G, group) float tensor by a finite value of the same group.

    Returns the filled copy, the flat indices of the replaced elements (int64) and their
    original values. The fill value is the group's finite minimum (0 for a group with no
    finite value), so the group's finite range is not widened.
    """
    finite = torch.isfinite(groups)
    idx = (~finite).view(-1).nonzero().view(-1)
    vals = groups.view(-1)[idx].clone()
    gmin = torch.where(finite, groups, torch.inf).amin(dim=1, keepdim=True)
    gmin = torch.where(torch.isfinite(gmin), gmin, torch.zeros_like(gmin))
    return torch.where(finite, groups, gmin), idx, vals


def restore_exceptions(flat: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Write the exactly kept values back into the decoded flat tensor (in place)."""
    if idx.numel():
        flat[idx] = vals.to(flat.dtype)
    return flat
