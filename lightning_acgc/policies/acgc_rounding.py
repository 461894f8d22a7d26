"""acgc under 16-bit precision: the gradient's own rounding noise, measured and set apart.

A 16-bit backward (``precision="bf16-mixed"``, ``"16-true"``, ...) rounds every op's result
to 8 or 11 significant bits. Change a saved tensor at all and the roundings downstream
change with it: the gradient moves by about the backward's own rounding noise, however
small the change. On the quick ResNet recipe in bf16-mixed every saved tensor at 8 bits
measured 0.024 against the exact gradient, 0.0074 in float32; the calibration read the
difference as the codecs' error, κ ran to 12-26 on the ResNet recipe and acgc held 9.0 MB
of its activations where float32 acgc holds 6.4 MB (``benchmarks/precision.py``).

So on a calibration step whose compressed tensors are 16-bit, one more pass moves each of
them by one ulp (every finite non-zero value one step up or down at random, zeros kept:
:class:`UlpJitter`), every other saved tensor as the step keeps it. Its distance from the
exact gradient, per module, is the *rounding floor* F_m: what any change at all costs the
gradient in this precision. The calibration then reads each module's error beyond it,
max(‖ĝ_m − g_m‖² − F_m², 0): the error compression adds to the precision's own (both are
noise of the same kind; against the true gradient they add in variance). κ, μ_m, λ and
the promise all read that; ``grad_error`` logs it, ``rounding_floor`` logs √(ΣF_m²)/‖g‖.
float32 tensors are not moved (their codecs' error is not rounded again at decode): the
floor is, if anything, low, and the error read beyond it high.

``rounding_floor=False`` reads the literal ‖ĝ − g‖ in every precision (the pass is skipped).
With the floor read, the ResNet recipe in bf16-mixed holds 5.7 MB at κ ≈ 1.
"""

from __future__ import annotations

import torch

from lightning_acgc.codecs.base import Codec, Packed
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.engine.step_inputs import SIXTEEN_BIT
from lightning_acgc.policies._acgc_stats import per_module_sq_diff

__all__ = ["FLOOR_PASS", "RoundingFloor", "UlpJitter"]

FLOOR_PASS = "<rounding floor>"  # the probe class of the floor pass (no site is named so)


class UlpJitter:
    """Holds a 16-bit tensor as it is and decodes it one ulp away: every finite non-zero
    value one step up or down (at random, from ``seed``), zeros, ±inf and NaN as they were.
    The floor pass's codec; not registered (no user picks it).

    Example:
        >>> x = torch.tensor([1.0, 0.0, -3.0, float("inf")], dtype=torch.bfloat16)
        >>> y = UlpJitter().decode(UlpJitter().encode(x, seed=0))
        >>> (y[[0, 2]] != x[[0, 2]]).all().item(), y[[1, 3]].tolist()
        (True, [0.0, inf])
        >>> (y[:3].float() - x[:3].float()).abs().tolist()  # one ulp: 2⁻⁷ at 1, 2⁻⁶ at 3
        [0.0078125, 0.0, 0.015625]
    """

    name = "ulp_jitter"
    whole = True  # holds the whole tensor on purpose: the engine keeps it as packed

    def encode(self, x: torch.Tensor, seed: int) -> Packed:
        return Packed(self.name, x.shape, x.dtype, {"raw": x}, {"seed": seed})

    def decode(self, packed: Packed) -> torch.Tensor:
        x = packed.payload["raw"]
        gen = torch.Generator(device=x.device).manual_seed(packed.meta["seed"])
        up = torch.rand(x.shape, generator=gen, device=x.device) < 0.5
        inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
        moved = torch.nextafter(x, torch.where(up, inf, -inf))
        return torch.where((x != 0) & torch.isfinite(x), moved, x)


class RoundingFloor:
    """The floor pass of :class:`~lightning_acgc.policies.acgc.ACGCPolicy` (a mixin over
    its probes: the pass runs as the first probe of a calibration, ``FLOOR_PASS``)."""

    rounding_floor = True  # the option: measure the floor on 16-bit calibration steps
    _metrics: dict[str, float]
    _exact: dict[str, torch.Tensor] | None
    _probe: str | None

    def __init__(self) -> None:
        super().__init__()
        self._sixteen_bit = False  # a calibration of this fit compressed a 16-bit tensor
        self._floor_sq: dict[str, float] = {}  # F_m² per module, this calibration's

    def begin_step(self, step: int) -> None:
        super().begin_step(step)  # type: ignore[misc]
        self._floor_sq = {}

    def setup(self, model: torch.nn.Module) -> None:
        super().setup(model)  # type: ignore[misc]
        self._sixteen_bit = False  # (a fit's precision is known from its first calibration)

    def note_precision(self, x: torch.Tensor) -> None:
        """A tensor the calibration step saves: whether its backward is a 16-bit one."""
        self._sixteen_bit = self._sixteen_bit or x.dtype in SIXTEEN_BIT

    def probe_classes(self, step: int) -> list[str]:
        chosen = super().probe_classes(step)  # type: ignore[misc]
        wants = self.rounding_floor and self._sixteen_bit and self._exact is not None
        return [FLOOR_PASS, *chosen] if wants and self._calibrating else chosen  # type: ignore[attr-defined]

    def begin_probe(self, cls: str) -> None:
        if cls == FLOOR_PASS:
            self._probe = cls  # codec_for asks probe_codec while a probe runs
            return
        super().begin_probe(cls)  # type: ignore[misc]

    def probe_codec(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        if self._probe != FLOOR_PASS:
            return super().probe_codec(site, x)  # type: ignore[misc]
        held = self.settings_codec(site, x)  # type: ignore[attr-defined]
        lossy = held is not None and held.name != "half"  # (float16 holds 16-bit values as is)
        return UlpJitter() if lossy and x.dtype in SIXTEEN_BIT else None

    def end_probe(self, cls: str, grads: dict[str, torch.Tensor] | None) -> None:
        if cls != FLOOR_PASS:
            super().end_probe(cls, grads)  # type: ignore[misc]
            return
        self._probe = None
        if grads is not None and self._exact is not None:
            self._floor_sq = per_module_sq_diff(grads, self._exact)
        self._calib_s += self._lap()  # type: ignore[attr-defined]  # (the pass: calib_ms)

    def beyond_floor(self, module_err: dict[str, float], g_sq: float = 0.0) -> dict[str, float]:
        """Each module's measured ‖ĝ_m − g_m‖² less its rounding floor F_m² (at least 0);
        with ``g_sq`` (‖g‖²), ``rounding_floor`` logged where the floor was measured."""
        floor = self._floor_sq
        if not floor:
            return module_err
        if g_sq > 0:
            self._metrics["rounding_floor"] = (sum(floor.values()) / g_sq) ** 0.5
        return {m: max(e - floor.get(m, 0.0), 0.0) for m, e in module_err.items()}
