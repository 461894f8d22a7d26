"""How rounding a training-mode BatchNorm's saved input reaches every layer's gradient.

BatchNorm's backward reads its saved input ``x`` through x̂ = (x − μ)/σ. For channel
``c`` (N values, γ its scale, δ the output gradient, m = mean(δ·x̂) = dγ/N), rounding
``x`` by ε (variance σ_ε² per value) changes the input gradient by

    Δδ_in = −(γ/σ)·(ε/σ · m  +  x̂ · mean(δ·ε/σ))

Two kinds of error follow, both measured against the exact gradient on ResNet-18 and
ResNet-50 (noise in one BatchNorm's input at a time, every layer's error read):

* the first part is noise of relative size r² = ‖Δδ_in‖²/‖δ_in‖² (the formula matched
  the measured r² within 20% on every BatchNorm), and it travels up the network like the
  true δ: every weight op m before the BatchNorm saw its output gradient off by 0.5-1x
  that r². Noise of that size in m's output gradient adds ``r²·fan_in_m·‖δ_m‖²·E[x_m²]``
  to ‖Δg_m‖² (x_m: m's input). Summed over the weight ops before it, this was 0.75-2.6x
  what each of ResNet-50's BatchNorms caused but the stem's (0.005x there: the second
  part dominates the first layers). The old error model counted it in one layer only, with a
  factor of the mean fan-in: up to 358x too high for ResNet-50's first BatchNorms and
  500x too low for its last, whose noise reaches all of its 50 convolutions
  (``benchmarks/bn_error_model.py``);
* the second part is x̂ times a number per channel: it lines up with the input of the
  op that made ``x`` (a convolution), whose weight gradient it moves coherently: row c
  by (γ/σ)·Δm·N·mean(x̂·patch). ``‖mean(x̂·patch)‖²`` is that op's weight gradient for
  an output gradient x̂/N (:func:`alignment`, one product on calibration steps; the
  cheap bound σ²/‖W_c‖² was 4-25x low on the quick ResNet). With it the local error
  matched the measured within 1.5x, and the model's total (both parts) was 0.94-2.7x
  the measured on ResNet-50's BatchNorms (the stem's 0.95x: the first part alone said
  0.005x) and 0.14-6.7x on the quick ResNet's (low on its first layers: the
  coherent part also reaches the ops further up, which the model leaves to κ).

:class:`BatchNormPaths` gathers what these need on a calibration step (per channel: the
input's variance, Σδ² of the output gradient and the alignment; per weight op: E[x²] of
its input at its first call, and the order of the forward) and turns them into one
factor per weight op, per unit of the input's mean rounding variance (the rounding of a
256-value group scales with its channel's spread, so channel c's variance is that mean
times var_c / mean var).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_acgc.policies._acgc_stats import reduce_tables
from lightning_acgc.policies.base import Reduce

__all__ = ["BatchNormPaths", "batch_norm_factors", "reduced"]


@dataclass
class _Reading:
    """One BatchNorm's statistics on a calibration step (per-channel tensors: no sync)."""

    local: str | None  # the weight op whose output is this BatchNorm's input
    var: torch.Tensor  # (C,) the input's variance per channel
    count: int  # values per channel
    align: torch.Tensor | None  # (C,) ‖mean(x̂_c·patch)‖² over the local op's input
    grad_sq: torch.Tensor | None = None  # (C,) Σ δ² of the output gradient per channel
    grad_sum: torch.Tensor | None = None  # (C,) Σ δ (dβ)
    calls: int = 1


class BatchNormPaths:
    """Hooks, on calibration steps only, that read what a BatchNorm input's δ path needs.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
        ...                       nn.Linear(4 * 6 * 6, 2))
        >>> paths = BatchNormPaths()
        >>> paths.setup(model, {"0", "3"})
        >>> paths.start()
        >>> model(torch.randn(8, 3, 8, 8)).square().sum().backward()
        >>> paths.stop()
        >>> grads = {f"{n}.{k}": p.grad for n, m in model.named_modules()
        ...          for k, p in m.named_parameters(recurse=False)}
        >>> table = paths.tables(grads)
        >>> table["1"]["usable"], table["1"]["local_order"] == table["0"]["order"]
        (1.0, True)
    """

    def __init__(self) -> None:
        self._modules: dict[str, nn.Module] = {}
        self._weight_ops: set[str] = set()
        self._handles: list[RemovableHandle] = []
        # the last weight op run: (id of its output, its name, its input, the module)
        self._last: tuple[int, str, torch.Tensor, nn.Module] | None = None
        self._order: dict[str, int] = {}  # first forward position per module
        self._input_sq: dict[str, torch.Tensor] = {}  # weight op -> E[x²] of its input
        self._readings: dict[str, _Reading] = {}
        self._bns: set[str] = set()
        self.unscale = 1.0  # 1 / the loss scale of an exact pass (GradientStats.exact_pass)

    def setup(self, model: nn.Module, weight_ops: set[str] | dict[str, int]) -> None:
        """The model's BatchNorms and weight ops (names, as ``named_modules`` gives)."""
        self.stop()
        named = dict(model.named_modules())
        self._weight_ops = {n for n in weight_ops if n in named}
        bns = {n for n, m in named.items() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        self._modules = {n: named[n] for n in self._weight_ops | bns}
        self._bns = bns

    def start(self) -> None:
        """Begin reading (clears the previous step's readings)."""
        self.stop()
        self._last, self._order, self._input_sq, self._readings = None, {}, {}, {}
        if not self._bns:  # nothing to read (a transformer): no hooks, no cost
            return
        for name, module in self._modules.items():
            if name in self._bns:
                self._handles.append(module.register_forward_pre_hook(self._bn_input(name)))
                self._handles.append(module.register_forward_hook(self._bn_output(name)))
            else:
                self._handles.append(module.register_forward_hook(self._weight_op(name)))

    def stop(self) -> None:
        """Stop reading; the readings stay until the next :meth:`start`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._last = None

    # -- hooks ----------------------------------------------------------------------
    def _enter(self, name: str) -> None:
        """Note ``name``'s forward. The first module run again starts a new pass (a noise
        budget's batch halves run before the exact pass): only the last pass is read."""
        if name not in self._order:
            self._order[name] = len(self._order)
        elif self._order[name] == 0:
            self._readings, self._input_sq, self._last = {}, {}, None

    def _weight_op(self, name: str):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            self._enter(name)
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
                self._input_sq.setdefault(name, x.detach().float().square().mean())
            self._last = None
            if isinstance(output, torch.Tensor) and isinstance(x, torch.Tensor):
                self._last = (id(output), name, x, module)  # held until the next op's hook

        return hook

    def _bn_input(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self._enter(name)
            x = args[0] if args else None
            if not (module.training and isinstance(x, torch.Tensor) and x.dim() >= 2):
                return
            if name in self._readings:
                self._readings[name].calls += 1
                return
            last, self._last = self._last, None
            with torch.no_grad():
                per_channel = x.detach().float().transpose(0, 1).reshape(x.shape[1], -1)
                var, mean = torch.var_mean(per_channel, dim=1, unbiased=False)
                local, align = None, None
                if last is not None and last[0] == id(x):
                    local, align = last[1], alignment(last[3], last[2], x, mean, var)
            self._readings[name] = _Reading(local, var, per_channel.shape[1], align)

        return hook

    def _bn_output(self, name: str):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            reading = self._readings.get(name)
            if reading is None or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return

            unscale = self.unscale

            def on_grad(grad: torch.Tensor) -> None:
                g = grad.detach().float().transpose(0, 1).reshape(grad.shape[1], -1) * unscale
                reading.grad_sq, reading.grad_sum = g.square().sum(1), g.sum(1)

            output.register_hook(on_grad)

        return hook

    # -- factors ----------------------------------------------------------------------
    def tables(self, grads: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
        """Per weight op run on this step: ``input_sq`` (E[x²] of its input) and ``order``
        (its forward position); per training-mode BatchNorm: ``propagated`` (r² per unit
        of its input's mean rounding variance), ``local`` (the coherent error in the
        weight gradient of the op that made its input, same unit), ``local_order`` (that
        op's position, −1: none), ``order`` and ``usable`` (0: called more than once, no
        gradient or no γ; the same keys on every rank, for the average over ranks).
        ``grads``: this step's gradients by parameter name (``weight``: dγ)."""
        out: dict[str, dict[str, float]] = {}
        for name, sq in self._input_sq.items():
            out[name] = {"input_sq": float(sq), "order": float(self._order[name])}
        for name, r in self._readings.items():
            module = self._modules[name]
            d_gamma = grads.get(f"{name}.weight")
            if d_gamma is None:
                d_gamma = getattr(getattr(module, "weight", None), "grad", None)
            row = {"order": float(self._order[name]), "local_order": -1.0, "usable": 0.0,
                   "propagated": 0.0, "local": 0.0}  # fmt: skip
            out[name] = row
            if r.calls != 1 or r.grad_sq is None or r.grad_sum is None or d_gamma is None:
                continue
            d_gamma = d_gamma.detach().float().reshape(-1)
            r2, local = batch_norm_factors(
                _weight(module, r.var), r.var, r.count, d_gamma, r.grad_sq, r.grad_sum, r.align
            )
            row.update(propagated=r2, local=local, usable=1.0)
            if r.local is not None:
                row["local_order"] = float(self._order[r.local])
        return out


Tables = dict[str, dict[str, float]]


def reduced(tables: Tables, reduce: Reduce | None) -> Tables:
    """``tables`` averaged over ranks (every rank reads the same model, so the same keys).

    Example:
        >>> reduced({"bn": {"order": 1.0}}, None)
        {'bn': {'order': 1.0}}
    """
    flat = {f"{m}\0{k}": v for m, row in tables.items() for k, v in row.items()}
    out: dict[str, dict[str, float]] = {}
    for key, v in reduce_tables(reduce, flat)[0].items():
        m, _, k = key.partition("\0")
        out.setdefault(m, {})[k] = v
    return out


def batch_norm_factors(
    gamma: torch.Tensor,
    var: torch.Tensor,
    count: int,
    d_gamma: torch.Tensor,
    grad_sq: torch.Tensor,
    grad_sum: torch.Tensor,
    align: torch.Tensor | None,
) -> tuple[float, float]:
    """``(r², local)`` per unit of the input's mean rounding variance (channel c's
    rounding variance taken as that mean · var_c / mean var): ‖Δδ_in‖²/‖δ_in‖² of the
    module docstring (‖δ_in,c‖² = (γ/σ)²·(Σδ² − (Σδ)²/N − dγ²/N), BatchNorm's backward),
    and the coherent part of the making op's weight-gradient error (``align``:
    ‖mean(x̂_c·patch)‖² per channel, :func:`alignment`; ``None``: not counted).

    Example:
        >>> one = torch.ones(2)
        >>> batch_norm_factors(one, one, 4, torch.zeros(2), one * 4, torch.zeros(2), one)
        (0.25, 8.0)
    """
    var = var.double().clamp_min(torch.finfo(torch.float32).tiny)
    rel = 1.0 / var.mean()  # (σ_ε,c/σ_c)² per unit mean variance
    g2 = gamma.double().square()
    d_gamma, grad_sq = d_gamma.double()[: var.numel()], grad_sq.double()
    # ‖Δδ_in‖²: Σ_c (γ/σ)²·(σ_ε/σ)²·(N·m² + mean δ²), m = dγ/N
    delta = float((g2 / var * rel * (d_gamma.square() / count + grad_sq / count)).sum())
    kept = grad_sq - grad_sum.double().square() / count - d_gamma.square() / count
    delta_in = float((g2 / var * kept.clamp_min(0)).sum())
    r2 = delta / delta_in if delta_in > 0 else 0.0
    if align is None:
        return r2, 0.0
    # Σ_c (γ/σ)²·(σ_ε/σ)²·Σδ²·‖mean(x̂_c·patch)‖²
    return r2, float((g2 / var * rel * grad_sq * align.double()).sum())


_CONV_WEIGHT_GRAD = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight}
_CONV_WEIGHT_GRAD[3] = torch.nn.grad.conv3d_weight


def alignment(
    op: nn.Module, op_input: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor
) -> torch.Tensor | None:
    """‖mean(x̂_c·patch)‖² per channel c of ``x`` = ``op(op_input)`` (a convolution or a
    linear layer; x̂ = x normalized per channel by its ``mean`` and ``var``, one value per
    channel): the weight gradient ``op`` would get
    from an output gradient x̂/N, row by row (one weight-gradient product, on
    calibration steps). ``None`` for other ops (or a padding mode other than zeros).

    Example:
        >>> conv = nn.Conv2d(2, 3, 3)
        >>> x_in = torch.randn(4, 2, 6, 6)
        >>> x = conv(x_in).detach()
        >>> var, mean = torch.var_mean(x.transpose(0, 1).reshape(3, -1), 1, unbiased=False)
        >>> a = alignment(conv, x_in, x, mean, var)
        >>> bound = var / conv.weight.detach().reshape(3, -1).square().sum(1)
        >>> bool((a >= bound * 0.999).all())  # ‖v_c‖ ≥ σ_c/‖W_c‖ (x̂·W_c·patch = σ_c x̂²)
        True
    """
    c, dims = x.shape[1], x.dim() - 2
    conv = isinstance(op, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and dims in _CONV_WEIGHT_GRAD
    conv = conv and op.padding_mode == "zeros" and not isinstance(op.padding, str)
    linear = isinstance(op, nn.Linear) and dims == 0
    if not (conv or linear) or op.weight.shape[0] != c:
        return None
    shape = (1, c, *([1] * dims))
    scale = var.clamp_min(1e-30).sqrt() * (x.numel() // c)
    xh = (x.detach().float() - mean.view(shape)) / scale.view(shape)  # x̂ / N
    inp = op_input.detach().float()
    if conv:
        grad = _CONV_WEIGHT_GRAD[dims](
            inp, op.weight.shape, xh, op.stride, op.padding, op.dilation, op.groups
        )
    else:
        grad = xh.t() @ inp.reshape(x.shape[0], -1)
    return grad.reshape(c, -1).square().sum(1)


def _weight(module: nn.Module, like: torch.Tensor) -> torch.Tensor:
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.numel() == like.numel():
        return w.detach().float()
    return torch.ones_like(like)
