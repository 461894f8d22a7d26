"""How activation error becomes gradient error, per saved tensor.

For an op that computes a weight gradient from its saved input (linear, conv), a
zero-mean error of variance σ² per input element adds ``σ²·fan_in·‖δ‖²`` to
``E‖Δg_W‖²`` (δ: the op's output gradient) — exact in expectation. Other ops (norms,
activations, attention) pass the error on into upstream gradients; for them we use
``‖δ‖²`` times the mean fan-in of the model's weight ops as the factor, except where the
path is known: a training-mode BatchNorm's input reaches every weight op before it
(:mod:`~lightning_acgc.policies.batch_norm_path`, an entry per op), and a ReLU's or a max
pool's own save adds nothing where the codec keeps the ReLU mask (``exact_masks``). The
input of a normalization (BatchNorm, LayerNorm, GroupNorm) is re-normalized in backward,
so an error there counts relative to the input's spread: its factor is also divided by the
input's variance; for an affine norm, the direct part in its own weight gradient is
counted as that module's (the AC-GC policy holds each layer to e, and a norm's γ
gradient is small but sees its own input's error fully). The AC-GC policy corrects the
total with the error it measures.

A tensor saved by several sites (a ReLU output that is also the next conv's input) is
packed once, by the first site; its sensitivity is the sum over all its sites. An
output remade at unpack from its saved input (``derived_from``, see
:mod:`lightning_acgc.engine.derive`) has no width of its own: its sensitivity joins its
input's, times the mean factor (``gain``; an activation's: f'(x)²) by which the input's
rounding reaches it. The outputs remade from one input carry images of one rounding error
(an attention's q, k and v, remade from the LayerNorm output they are products of): where
their errors pass on through δ, they add as amplitudes, not variances, so the holder's
other-ops factor counts them as (Σ√c_i)² (the bound of Cauchy-Schwarz). Counted as
independent, BERT's attention key broke its layer's bound on 2 of 75 calibrations (1.16x)
and the char-LM's fused qkv on 2 of 135; counted together, 0 of 75 and 1 of 135 (promise,
full: 281 of 282, ratios within the seeds' spread).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from lightning_acgc.engine.meter import LOSS_HALF, SiteRecord
from lightning_acgc.engine.sites import NORM_TYPES, is_norm_statistic, is_norm_type, is_row_norm

__all__ = [
    "NORM_TYPES",
    "TensorSensitivity",
    "batch_norm_entries",
    "is_batch_norm_input",
    "is_norm_statistic",
    "norm_inv_var",
    "saturating_output",
    "softmax_output",
    "tensor_sensitivities",
]

# Codec names that mean "not chosen by the policy" in a SiteRecord (a tensor the policy
# itself chose to keep, settings "policy", is the policy's and stays in the model).
NOT_POLICY = ("kept", "mask")
# Ops whose backward reads their saved tensor only through which values are zero (ReLU)
# or not at all (a max pool reads its indices).
MASK_READERS = frozenset({"ReLU", "MaxPool1d", "MaxPool2d", "MaxPool3d"})


def _policy_packed(rec: SiteRecord) -> bool:
    if rec.settings == LOSS_HALF:  # the engine's, whatever the policy
        return False
    return rec.codec not in NOT_POLICY or (rec.codec == "kept" and rec.settings == "policy")


@dataclass
class TensorSensitivity:
    """One packed tensor: its first site, its size, and ``E‖Δg‖² / σ²`` split by kind."""

    key: str
    numel: int
    weight: float = 0.0  # from weight ops (analytic)
    other: float = 0.0  # from the remaining ops (heuristic)
    weight_by_module: dict[str, float] = field(default_factory=dict)  # weight, per op
    keeps_mask: bool = False  # a ReLU output whose δ path is exact only while its mask is
    mask_only: bool = True  # every op that saved it reads only its mask (or nothing)

    @property
    def total(self) -> float:
        return self.weight + self.other

    def add(self, module: str, c: float) -> None:
        """Add ``c`` to the factor of weight op (or affine norm) ``module``."""
        self.weight += c
        self.weight_by_module[module] = self.weight_by_module.get(module, 0.0) + c


def tensor_sensitivities(
    records: dict[str, SiteRecord],
    grad_sq: dict[str, float],
    fan_in: dict[str, int],
    inv_var: dict[str, float] | None = None,
    norm_params: Collection[str] = (),
    batch_norm: dict[str, dict[str, float]] | None = None,
    exact_masks: bool = False,
) -> dict[str, TensorSensitivity]:
    """Sensitivity of every policy-packed tensor of a step.

    Args:
        records: the step's site records (``engine.stats.sites``).
        grad_sq: squared output-gradient norm by module name (``GradientStats.stop``).
        fan_in: fan-in by module name for weight ops.
        inv_var: 1 / variance of the saved input, by site key, for normalization sites.
        norm_params: normalization modules with an affine weight. Their saved input's error
            (relative to its spread) also enters their own weight gradient directly
            (dγ = Σ δ·x̂): that part, ``‖δ‖²/var``, is counted as theirs in
            ``weight_by_module`` besides the part passed on through δ.
        batch_norm: :meth:`~lightning_acgc.policies.batch_norm_path.BatchNormPaths.tables`
            of this step. A training-mode BatchNorm's input found there reaches every
            weight op before it (an entry per op, see that module), instead of the
            heuristic factor.
        exact_masks: the policy keeps a ReLU output's mask exact (zeros stay zeros,
            positives stay positive: quant at 2 bits or more, or a remade output), so
            the ReLU's backward, which reads only that mask, adds no error; nor does a
            max pool's (it reads its indices). Their sites add nothing; the holders of
            ReLU outputs stored by the policy itself get ``keeps_mask``.

    Example:
        >>> rec = SiteRecord("fc:0", "fc", "Linear", (8, 4), "float32", "bounded", "")
        >>> tensor_sensitivities({"fc:0": rec}, {"fc": 2.0}, {"fc": 4})["fc:0"].weight
        8.0
    """
    fallback = max(grad_sq.values(), default=0.0)
    mean_fan_in = sum(fan_in.values()) / len(fan_in) if fan_in else 1.0
    out: dict[str, TensorSensitivity] = {}
    for rec in records.values():
        if not _policy_packed(rec) or rec.shared_with or rec.derived_from:
            continue
        numel = 1
        for d in rec.shape:
            numel *= d
        out[rec.key] = TensorSensitivity(rec.key, numel)
    tables = batch_norm or {}
    coherent: dict[str, list[float]] = {}  # per holder: its derived outputs' other-ops parts
    for rec in records.values():
        for key, gain, derived in _holders(records, rec):
            root = out.get(key)
            if root is None:
                continue
            delta_sq = gain * (grad_sq.get(rec.module, fallback) if rec.module else fallback)
            root.mask_only &= exact_masks and rec.module_type in MASK_READERS
            if rec.module in fan_in:
                root.add(rec.module, fan_in[rec.module] * delta_sq)
                continue
            norm = is_norm_type(rec.module_type)
            scale = (inv_var or {}).get(rec.key, 1.0) if norm else 1.0
            path = tables.get(rec.module, {}) if "BatchNorm" in rec.module_type else {}
            if exact_masks and rec.module_type in MASK_READERS:
                root.keeps_mask |= rec.module_type == "ReLU" and not derived
            elif path.get("usable", 0.0) >= 1.0:  # on every rank
                for m, c in batch_norm_entries(path, tables, fan_in, grad_sq).items():
                    root.add(m, c * gain)
            else:
                c = mean_fan_in * delta_sq * scale
                root.other += c
                if derived:
                    coherent.setdefault(key, []).append(c)
            if rec.module in norm_params and norm:
                root.add(rec.module, delta_sq * scale)
    for key, parts in coherent.items():
        out[key].other += sum(math.sqrt(c) for c in parts) ** 2 - sum(parts)
    return out


def batch_norm_entries(
    path: dict[str, float],
    tables: dict[str, dict[str, float]],
    fan_in: dict[str, int],
    grad_sq: dict[str, float],
) -> dict[str, float]:
    """A BatchNorm input's factor per weight op (``path``: its row of ``tables``, see
    :mod:`~lightning_acgc.policies.batch_norm_path`): each op m before it in the forward
    gets ``r²·fan_in_m·‖δ_m‖²·E[x_m²]``; the op that made the input also the coherent part.

    Example:
        >>> tables = {"conv": {"order": 0.0, "input_sq": 2.0},
        ...           "bn": {"order": 1.0, "propagated": 0.5, "local": 3.0, "local_order": 0.0,
        ...                  "usable": 1.0}}
        >>> batch_norm_entries(tables["bn"], tables, {"conv": 4}, {"conv": 1.0})
        {'conv': 7.0}
    """
    out: dict[str, float] = {}
    for m, row in tables.items():
        if m in fan_in and "input_sq" in row and row["order"] < path["order"]:
            out[m] = path["propagated"] * fan_in[m] * grad_sq.get(m, 0.0) * row["input_sq"]
            if row["order"] == path.get("local_order", -1.0):
                out[m] += path["local"]
    return out


def _holders(records: dict[str, SiteRecord], rec: SiteRecord) -> list[tuple[str, float, bool]]:
    """The sites whose tensors hold ``rec``'s values (through shared tensors and derived
    outputs, a GELU of a LayerNorm's output of a compressed input; both sides of a
    residual sum), each with the product of the derivations' gains on the way and whether
    there was one."""
    out: list[tuple[str, float, bool]] = []
    todo = [(rec.shared_with or rec.key, 1.0, False)]
    for _ in range(4 * len(records) + 4):  # a bound: the records form no cycle
        if not todo:
            break
        key, gain, derived = todo.pop()
        held = records.get(key)
        if held is None or not (held.shared_with or held.derived_from):
            out.append((key, gain, derived))
        elif held.shared_with:
            todo.append((held.shared_with, gain, derived))
        else:
            todo.append((held.derived_from, gain * held.gain, True))  # type: ignore[arg-type]
            todo.extend((k, gain * g, True) for k, g in held.also_from)
    return out


def is_batch_norm_input(module_type: str, x: torch.Tensor) -> bool:
    """Whether ``x``, saved inside a module of type ``module_type``, is a BatchNorm's
    input: a floating tensor of at least two dimensions (channels in dimension 1).

    Example:
        >>> is_batch_norm_input("BatchNorm2d", torch.zeros(2, 3, 4, 4))
        True
        >>> is_batch_norm_input("LayerNorm", torch.zeros(2, 3, 4))
        False
    """
    return "BatchNorm" in module_type and x.dim() >= 2 and x.is_floating_point()


# Activations whose backward reads their saved output in a product with itself (tanh:
# 1 − y², sigmoid: y·(1 − y), softmax: p·(g − Σ p·g)): unbiased rounding of y biases it by
# the rounding variance (E[ŷ²] = y² + Var). At 1 bit BERT's pooler tanh (its 1 − ŷ² near 0
# for every value) shrank the whole model's gradient: the sweep's BERT ended 7-11% above
# plain at e = 0.3-0.6. They get at least BIAS_FLOOR bits (variance under 1% of the range²).
SATURATING_TYPES = frozenset({"Tanh", "Sigmoid", "Softmax", "Softmin", "LogSoftmax", "Hardtanh"})
# The same activations called as functions (F.softmax inside an attention module, torch.tanh
# in a gate): known by the autograd node that made the saved tensor, their output.
SATURATING_OPS = frozenset(
    {"TanhBackward0", "SigmoidBackward0", "SoftmaxBackward0", "LogSoftmaxBackward0"}
)
BIAS_FLOOR = 4
# Softmax outputs (a module of these types, or F.softmax: its autograd node). The gradients
# that reach an attention's query and key through the softmax's backward are 1e-6 of
# ‖g‖² and nearly cancel: rounding the saved probabilities alone, at 8 bits, put a key's
# gradient at 10x its own bound on some steps of the BERT recipe; as float16, within it.
SOFTMAX_TYPES = frozenset({"Softmax", "Softmin"})
SOFTMAX_OPS = frozenset({"SoftmaxBackward0"})


def saturating_output(x: torch.Tensor) -> bool:
    """Whether ``x`` is the output of a saturating activation, however it was called.

    Example:
        >>> s = torch.randn(2, 8, requires_grad=True)
        >>> saturating_output(torch.softmax(s, -1)), saturating_output(torch.relu(s))
        (True, False)
    """
    return _made_by(x, SATURATING_OPS)


def softmax_output(x: torch.Tensor) -> bool:
    """Whether ``x`` is a softmax's output, however it was called.

    Example:
        >>> s = torch.randn(2, 8, requires_grad=True)
        >>> softmax_output(torch.softmax(s, -1)), softmax_output(torch.tanh(s))
        (True, False)
    """
    return _made_by(x, SOFTMAX_OPS)


def _made_by(x: torch.Tensor, ops: frozenset[str]) -> bool:
    """Whether the autograd node that made ``x`` is one of ``ops`` (by name)."""
    node = x.grad_fn
    return node is not None and node.name() in ops


def norm_inv_var(x: torch.Tensor, module_type: str) -> float | None:
    """Mean of 1/variance over the groups a normalization normalizes (channels for
    BatchNorm, rows of the last dimension for LayerNorm/RMSNorm, the whole tensor
    otherwise): the factor by which its input's error enters x̂. ``None`` if undefined.

    Example:
        >>> x = torch.cat([torch.randn(64, 1, 8) * 10, torch.randn(64, 1, 8)], dim=1)
        >>> round(norm_inv_var(x, "BatchNorm1d"), 1) > 1 / x.var().item()
        True
    """
    batch_norm = is_batch_norm_input(module_type, x)
    x = x.detach().float()
    if batch_norm:
        var = x.transpose(0, 1).reshape(x.shape[1], -1).var(dim=1)
    elif is_row_norm(module_type) and x.dim() >= 1 and x.shape[-1] > 1:
        var = x.reshape(-1, x.shape[-1]).var(dim=1)
    else:
        var = x.reshape(1, -1).var(dim=1)
    var = var[torch.isfinite(var) & (var > 0)]
    return float((1.0 / var).mean()) if var.numel() else None
