"""Tensors saved inside a module written op by op, remade by running it again.

Hugging Face's ``NewGELUActivation`` (GPT-2's, GPT-J's and CodeGen's MLP) computes
``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` op by op: autograd saves x (for the
power), the tanh, 0.5·x and 1 + tanh, each of x's size, and the next layer saves the
result. Llama's ``LlamaRMSNorm`` (and Mistral's, Qwen's, T5's) saves its input, its
1/rms per row, the normalized input (for its weight's gradient), and the next Linear
saves its output. No single-op derivation (:mod:`~lightning_acgc.engine.derive`)
remakes them: an add of a Python number does not keep the number in the graph. The
module does: while it runs, :class:`ModuleReplays` notes its input; a tensor of the
input's size that it saves (or its output, saved by a later op) whose history leads
back to that input through smooth elementwise ops, means and sums only
(:data:`SMOOTH_NODES`, :data:`REDUCTION_NODES`; the module's own parameters aside) is
remade at unpack by running the module's ``forward`` again on the decoded input, with
grad on and its saves captured, once for all the tensors of one call (:class:`Rerun`).
A statistic smaller than the input (the 1/rms) is left to the engine (kept exactly).

A module qualifies when it holds no buffers or submodules (parameters, read again at
unpack, must not change in place before it), and its ``forward`` must not branch on its
input's values (run on the decoded input it must save what it saved; where the sizes
differ, backward raises). Each site is checked before it is first
remade, and again on every step that measures: the module run again on the exact input
must give that tensor bit for bit (a random op in the module, an argument the hook does
not see, fails it), or the site is left to its codec for good. A module whose ops jump
(a ReLU, a clamp) is not remade: the decoded input would flip its masks (see
:mod:`~lightning_acgc.policies.checkpoint_regions`). The error model charges a remade
tensor to the input with a gain measured on steps that measure (:meth:`Rerun.gain`).

Example:
    >>> class Swish(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * torch.sigmoid(x)
    >>> swish, x = Swish(), torch.randn(8, requires_grad=True)
    >>> saves, out = replay(swish, x, autocast_state(x))
    >>> [s.shape for s in saves], torch.equal(out, swish(x).detach())
    ([torch.Size([8]), torch.Size([8]), torch.Size([8])], True)
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_acgc.engine.derive_cast import CAST_NODE
from lightning_acgc.engine.derive_graph import Derivation, Origin, check_unchanged, placed

__all__ = ["SMOOTH_NODES", "ModuleReplays", "Rerun", "autocast_state", "replay"]

# autograd nodes of elementwise ops with a derivative and no jump: what a remade
# tensor's history may hold between the module's input and it
SMOOTH_NODES = frozenset(
    {
        "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward0",
        "RsubBackward1", "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1",
        "PowBackward0", "NegBackward0", "TanhBackward0", "SigmoidBackward0", "ExpBackward0",
        "Exp2Backward0", "Expm1Backward0", "LogBackward0", "Log1pBackward0", "ErfBackward0",
        "SqrtBackward0", "RsqrtBackward0", "ReciprocalBackward0", "SinBackward0",
        "CosBackward0", "GeluBackward0", "SiluBackward0", "SoftplusBackward0",
        "MishBackward0", "ToCopyBackward0",
    }
)  # fmt: skip
# a row's or a tensor's mean or sum: a norm written out (Llama's RMSNorm: the mean of x²)
REDUCTION_NODES = frozenset({"MeanBackward0", "MeanBackward1", "SumBackward0", "SumBackward1"})
OUTPUT = -1  # the index of a call's output among what a replay gives
_WALK_LIMIT = 64  # nodes a history may hold between the input and a remade tensor
_GAIN_SAMPLES = 1 << 16  # values a gain is read on


def autocast_state(x: torch.Tensor) -> tuple[str, bool, torch.dtype]:
    """Autocast's state for ``x``'s device now: a replay runs under the same."""
    kind = x.device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def replay(
    module: nn.Module, x: torch.Tensor, autocast: tuple[str, bool, torch.dtype]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What ``module.forward(x)`` saves for backward (detached, in order; not its
    parameters, which the engine never packs) and its output, run with grad on under
    ``autocast`` (its module hooks do not run)."""
    saves: list[torch.Tensor] = []
    params = {id(p) for p in module.parameters(False)}

    def capture(t: torch.Tensor) -> int:
        if id(t) in params or (t._base is not None and id(t._base) in params):
            return 0
        saves.append(t.detach())
        return len(saves)

    def never(_: int) -> torch.Tensor:
        raise RuntimeError("lightning_acgc: a module's replay is not differentiated")

    kind, enabled, dtype = autocast
    with (
        torch.autocast(kind, dtype=dtype, enabled=enabled),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(capture, never),
    ):
        out = module.forward(x.detach().requires_grad_())
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"lightning_acgc: {type(module).__name__} returned no tensor")
    return saves, out.detach()


def _qualifies(module: nn.Module) -> bool:
    """No buffers or submodules, and a ``forward`` of its own (parameters allowed)."""
    own_forward = type(module).forward is not nn.Module.forward
    return own_forward and not any(True for _ in (*module.buffers(False), *module.children()))


def smooth_history(t: torch.Tensor, source: Origin, module: nn.Module | None = None) -> bool:
    """Whether ``t``'s history reaches ``source`` and holds nothing but smooth
    elementwise ops (:data:`SMOOTH_NODES`) and means or sums (:data:`REDUCTION_NODES`)
    on the way, besides constants and ``module``'s own parameters."""
    start = t.grad_fn
    if start is None or source.made((start, t.output_nr)):
        return False
    stack, seen, reached = [start], set(), False
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        kind = type(node).__name__
        if len(seen) > _WALK_LIMIT or (kind not in SMOOTH_NODES and kind not in REDUCTION_NODES):
            return False
        for edge in node.next_functions:
            if edge[0] is None or _own_param(edge[0], module):
                continue
            if source.made(edge):
                reached = True
            else:
                stack.append(edge[0])
    return reached


def _uncast(t: torch.Tensor) -> tuple[object, int]:
    """The node and slot that made ``t``, or, for a dtype cast of a tensor (autocast's
    16-bit copy of a float32 output for the Linear after it), those of its input."""
    node = t.grad_fn
    if type(node).__name__ == CAST_NODE and len(node.next_functions) == 1:  # type: ignore[union-attr]
        return node.next_functions[0]  # type: ignore[union-attr]
    return node, t.output_nr


def _one_op(t: torch.Tensor, source: Origin) -> bool:
    """Whether ``t`` is made by one op straight from ``source`` (an ``nn.GELU``'s)."""
    node = t.grad_fn
    return node is not None and any(source.made(edge) for edge in node.next_functions)


def _own_param(node: object, module: nn.Module | None) -> bool:
    variable = getattr(node, "variable", None)  # (an AccumulateGrad's)
    if variable is None or module is None:
        return False
    return any(variable is p for p in module.parameters(False))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if width is None:
        return torch.equal(a, b)
    return torch.equal(a.detach().view(width), b.detach().view(width))


class Rerun:
    """One call's replay at unpack, shared by the tensors remade from it: run once on
    the decoded input and kept until each of its ``users`` has taken its tensor (run
    again where a value is asked for twice, or on another decoded input)."""

    def __init__(self, module: nn.Module, autocast: tuple[str, bool, torch.dtype]) -> None:
        self.module, self.autocast, self.users = module, autocast, 0
        # (read at unpack: a parameter changed in place since forward is an error)
        params = module.parameters(False)
        self.unchanged = check_unchanged(f"a parameter of {type(module).__name__}", *params)
        self._of: torch.Tensor | None = None
        self._made: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self._gains: tuple[torch.Tensor, dict[int, float]] | None = None

    def take(self, x_hat: torch.Tensor, index: int) -> torch.Tensor:
        if self._made is None or self._of is not x_hat:
            self.unchanged()
            self._made, self._of = replay(self.module, x_hat, self.autocast), x_hat
        saves, out = self._made
        self.users -= 1
        if self.users <= 0:
            self._made = self._of = None
        return out if index == OUTPUT else saves[index]

    def gain(self, x: torch.Tensor, index: int) -> float:
        """The mean factor from ``x``'s rounding variance to the variance it puts in the
        tensor at ``index``: ‖f(x + δ) − f(x)‖² / ‖δ‖² for a small δ of independent
        values (f'(x)² for an elementwise f; γ²/σ² for a norm), once for all of a
        call's tensors on ``x``. 1.0 where none is finite."""
        if self._gains is None or self._gains[0] is not x:
            try:
                self._gains = (x, self._all_gains(x))
            except Exception:  # a module that does not run on its moved input: no reading
                self._gains = (x, {})
        return self._gains[1].get(index, 1.0)

    def _all_gains(self, x: torch.Tensor) -> dict[int, float]:
        values = x.detach()
        # (the ratios read on an evenly spaced sample of the values: the noise goes to all)
        sample = slice(None, None, max(1, values.numel() // _GAIN_SAMPLES))
        flat = values.reshape(-1)[sample].double()
        finite = flat[torch.isfinite(flat)]
        rms = float(finite.square().mean().sqrt()) if finite.numel() else 1.0
        step = max(1e-3, 4 * torch.finfo(values.dtype).eps) * max(rms, 1e-12)
        g = torch.Generator(device=values.device).manual_seed(0)  # (not the global RNG)
        noise = torch.randn(values.shape, generator=g, device=values.device) * step
        moved = (values + noise.to(values.dtype)).to(values.dtype)
        delta = moved.reshape(-1)[sample].double() - flat
        (saves, out), (saves_moved, out_moved) = (
            replay(self.module, values, self.autocast),
            replay(self.module, moved, self.autocast),
        )
        gains = {}
        pairs = [*enumerate(zip(saves, saves_moved, strict=False)), (OUTPUT, (out, out_moved))]
        for index, (a, b) in pairs:
            if a.numel() != values.numel() or a.shape != b.shape:
                continue
            change = b.reshape(-1)[sample].double() - a.reshape(-1)[sample].double()
            keep = torch.isfinite(change) & torch.isfinite(delta) & (delta != 0)
            if keep.any():
                gains[index] = float(change[keep].square().mean() / delta[keep].square().mean())
        return gains


@dataclass(eq=False)
class _Call:
    """A running (or finished) call of a qualifying module."""

    module: nn.Module
    name: str
    source: Origin  # its input's place in the graph
    first: int  # the module's ordinal of its first save in this call
    autocast: tuple[str, bool, torch.dtype]
    x: torch.Tensor | None = None  # the input itself, while the call runs
    source_numel: int = 0
    checked: tuple[list[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    _rerun: Rerun | None = field(default=None, repr=False)

    @property
    def rerun(self) -> Rerun:
        """Made at first use, in forward (its parameters' versions are forward's): most
        calls (a Linear's, a convolution's) never have a tensor remade."""
        if self._rerun is None:
            self._rerun = Rerun(self.module, self.autocast)
        return self._rerun

    def exact(self) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """The module run again on the exact input (once a call; RNG state untouched)."""
        if self.checked is None and self.x is not None:
            devices = [self.x.device] if self.x.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), contextlib.suppress(Exception):
                self.checked = replay(self.module, self.x, self.autocast)
        return self.checked


class ModuleReplays:
    """The calls of qualifying modules in a step, noted by the module tracker's hooks,
    and the plans that remake what they saved (see the module docstring)."""

    def __init__(self) -> None:
        # set by the engine: its policy now (one that sets ``derives_elementwise``, as
        # acgc, has calls noted; one ``measuring`` has its sites checked again)
        self.policy: Callable[[], object] = _none
        self._qualifying: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._running: list[_Call] = []
        self._outputs: deque[tuple[object, int, _Call]] = deque(maxlen=32)
        self._verdicts: dict[tuple[str, int], bool] = {}  # (module, index): remade

    def new_step(self) -> None:
        self._running.clear()
        self._outputs.clear()

    def forget(self) -> None:
        self.new_step()
        self._verdicts.clear()

    def enter(self, module: nn.Module, name: str, args: tuple, ordinal: int) -> None:
        if not getattr(self.policy(), "derives_elementwise", False):
            return
        qualifies = self._qualifying.get(module)
        if qualifies is None:
            qualifies = self._qualifying[module] = _qualifies(module)
        if not qualifies or len(args) != 1 or not torch.is_grad_enabled():
            return
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.grad_fn is None or not x.is_floating_point():
            return  # (a leaf input, a parameter's, is read again by no replay: not versioned)
        state = autocast_state(x)
        self._running.append(_Call(module, name, Origin.of(x), ordinal, state, x, x.numel()))

    def exit(self, module: nn.Module, output: object) -> None:
        if not self._running or self._running[-1].module is not module:
            return
        call = self._running.pop()
        if not isinstance(output, torch.Tensor) or _one_op(output, call.source):
            pass  # (one op on the input: engine/derive.py remakes its output, if any)
        elif smooth_history(output, call.source, call.module):
            self._outputs.append((output.grad_fn, output.output_nr, call))
            self._check(call, OUTPUT, output)
        call.x = call.checked = None

    def candidate(self, module: str, t: torch.Tensor) -> bool:
        """Whether ``t``, saved now inside ``module``, may be a call's (cheap)."""
        base = t if t._base is None else t._base
        if self._running and self._running[-1].name == module:
            return True
        made = _uncast(base)[0]
        return any(node is made for node, _, _ in self._outputs)

    def plan(
        self, module: str, ordinal: int, t: torch.Tensor, recent: list[Origin]
    ) -> Derivation | None:
        """How to remake ``t`` (saved at site ``module:ordinal``) from a call's input in
        ``recent`` (oldest first); None where it is no call's."""
        base = t if t._base is None else t._base
        call, index = self._call_of(module, ordinal, base)
        if call is None or not base.is_contiguous() or base.numel() != call.source_numel:
            return None  # (a norm's statistics, smaller than its input: kept as before)
        if not smooth_history(base, call.source, call.module):
            return None
        i = next((j for j in range(len(recent) - 1, -1, -1) if _is(recent[j], call.source)), None)
        if i is None or not self._check(call, index, base):
            return None
        rerun, place, dtype, shape = call.rerun, placed(t, base), base.dtype, base.shape
        rerun.users += 1
        module = type(call.module).__name__

        def fn(x_hat: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():  # (cast as autocast cast the output for a 16-bit op)
                made = rerun.take(x_hat, index)
            if made.shape != shape:  # (a branch on the input's values took another way)
                raise RuntimeError(
                    f"lightning_acgc: {module} run again on its decoded input saved other "
                    "tensors than in forward (its forward branches on its input's values?),"
                    " so acgc cannot remake them; train this model with another policy"
                )
            return place(made.to(dtype))

        def gain(x: torch.Tensor | None) -> float:
            return 1.0 if x is None else rerun.gain(x, index)

        name = "output" if index == OUTPUT else f"save {index}"
        if _uncast(base)[0] is not base.grad_fn:
            name = f"{name}, {str(dtype).removeprefix('torch.')}"
        return Derivation(fn, (i,), f"{type(call.module).__name__} run again ({name})", gain)

    def _call_of(self, module: str, ordinal: int, base: torch.Tensor) -> tuple[_Call | None, int]:
        made, slot_made = _uncast(base)  # (an output, or autocast's cast of one)
        for node, slot, call in reversed(self._outputs):
            if node is made and slot == slot_made:
                return call, OUTPUT
        if self._running and self._running[-1].name == module:
            call = self._running[-1]
            return call, ordinal - call.first
        return None, 0

    def _check(self, call: _Call, index: int, t: torch.Tensor) -> bool:
        """Whether ``t`` is what the call run again gives at ``index``: the verdict kept
        for the site, looked at again on measuring steps while the call runs."""
        key = (call.name, index)
        verdict = self._verdicts.get(key)
        measuring = getattr(self.policy(), "measuring", False)
        if verdict is False or call.x is None or (verdict and not measuring):
            return bool(verdict)
        made = call.exact()
        ok = made is not None and (index == OUTPUT or 0 <= index < len(made[0]))
        ok = ok and _same_bits(made[1] if index == OUTPUT else made[0][index], t)  # type: ignore[index]
        self._verdicts[key] = ok
        return ok


def _none() -> None:
    return None


def _is(origin: Origin, source: Origin) -> bool:
    return (
        origin.node is source.node
        and origin.slot == source.slot
        and origin.leaf is source.leaf
        and origin.shape == source.shape
        and origin.dtype == source.dtype
    )
