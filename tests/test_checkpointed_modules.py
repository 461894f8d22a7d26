"""``CheckpointedModules`` and the callback's ``checkpoint_modules``: the named blocks
run under ``torch.utils.checkpoint`` during the fit (gradients exact, fewer tensors
saved), compression takes what is still saved, and every ``forward`` is put back at fit
end, after an exception, and where the user had one of their own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_acgc.checkpointing as checkpointing
from lightning_acgc import ActivationCompression, CheckpointedModules, compress_activations
from lightning_acgc.codecs import Codec, CodecSpec
from lightning_acgc.engine.sites import SiteInfo
from lightning_acgc.policies.fixed import FixedPolicy


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.outer(torch.tanh(self.inner(x)))


class _Net(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList([_Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h)


class _Seen(FixedPolicy):
    """Fixed float16 everywhere; counts the checkpointed regions' inputs it is asked about."""

    def __init__(self) -> None:
        super().__init__(CodecSpec(codec="half"))
        self.checkpoint_inputs = 0

    def codec_for(self, site: SiteInfo, x: torch.Tensor) -> Codec | None:
        self.checkpoint_inputs += bool(site.checkpoint_input)
        return super().codec_for(site, x)


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize("bad", ["", [], [""], ["ok", 3], 5])
def test_bad_patterns_are_refused_at_construction(bad: object) -> None:
    with pytest.raises(ValueError, match="checkpoint_modules"):
        CheckpointedModules(bad)  # type: ignore[arg-type]
    if bad != []:  # an empty list is "none" for the callback
        with pytest.raises(ValueError, match="checkpoint_modules"):
            ActivationCompression(checkpoint_modules=bad)  # type: ignore[arg-type]


def test_off_policy_refuses_checkpoint_modules() -> None:
    with pytest.raises(ValueError, match="policy='off'"):
        ActivationCompression(policy="off", checkpoint_modules="_Block")


def test_matches_by_class_and_by_name_outermost_only() -> None:
    model = _Net()
    assert CheckpointedModules("_Block").matches(model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert CheckpointedModules(["blocks.[02]"]).matches(model) == ["blocks.0", "blocks.2"]
    # a block and the layers inside it both match: only the block
    assert CheckpointedModules(["blocks.1", "Linear"]).matches(model) == [
        "stem", "blocks.0.inner", "blocks.0.outer", "blocks.1", "blocks.2.inner",
        "blocks.2.outer", "head",
    ]  # fmt: skip
    assert CheckpointedModules("*").matches(model)[0] == "stem"  # never the model itself


def test_no_match_names_the_model_classes() -> None:
    with pytest.raises(
        ValueError, match=r"matches no module of _Net; its module classes: .*_Block"
    ):
        CheckpointedModules("BertLayer").install(_Net())


def test_gradients_are_exact_and_forward_is_restored() -> None:
    torch.manual_seed(0)
    model = _Net()
    x, y = _data()
    plain = _grads(model, x, y)
    blocks = CheckpointedModules("_Block")
    assert blocks.install(model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert all("forward" in vars(b) for b in model.blocks)
    for a, b in zip(plain, _grads(model, x, y), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    blocks.remove()
    blocks.remove()  # idempotent
    assert not blocks.installed and all("forward" not in vars(b) for b in model.blocks)


def test_fewer_tensors_saved_and_block_inputs_marked() -> None:
    torch.manual_seed(0)
    model = _Net(width=64)
    x, y = _data()
    saved, marked = {}, {}
    for patterns in (None, "_Block"):
        blocks = CheckpointedModules(patterns) if patterns else None
        if blocks is not None:
            blocks.install(model)
        policy = _Seen()
        with compress_activations(policy=policy, model=model, min_numel=0) as stats:
            F.cross_entropy(model(x), y).backward()
        saved[patterns], marked[patterns] = stats.saved_bytes, policy.checkpoint_inputs
        if blocks is not None:
            blocks.remove()
    assert saved["_Block"] < 0.7 * saved[None]  # each block keeps its input alone
    assert marked[None] == 0 and marked["_Block"] == 3


def test_tensor_keyword_arguments_are_saved_through_the_hooks() -> None:
    """A block called with a tensor keyword argument: checkpoint saves it as an input
    (marked, counted), and the block gets it under its own name."""

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, *, gate: torch.Tensor, checkpoint: int = 0):
            return torch.tanh(self.fc(x)) * gate + checkpoint  # a keyword named like it

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Gated())
    x, leaf = torch.randn(64, 8), torch.randn(64, 16, requires_grad=True)
    # an activation: a leaf that needs grad passes as a parameter
    expected = torch.autograd.grad(model[1](model[0](x), gate=leaf * 1.0).sum(), leaf)[0]
    blocks = CheckpointedModules("Gated")
    blocks.install(model)
    policy = _Seen()
    with compress_activations(policy=policy, model=model, min_numel=0):
        out = model[1](model[0](x), gate=leaf * 1.0, checkpoint=1)
        got = torch.autograd.grad(out.sum() - 64 * 16, leaf)[0]
    blocks.remove()
    assert policy.checkpoint_inputs == 2  # x and gate
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)  # float16 inputs


def test_no_grad_runs_the_block_as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = checkpointing.checkpoint
    monkeypatch.setattr(
        checkpointing, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    model = _Net()
    blocks = CheckpointedModules("_Block")
    blocks.install(model)
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert calls == []
    model(torch.randn(2, 8)).sum().backward()
    assert len(calls) == 3
    blocks.remove()


def test_a_users_own_instance_forward_is_put_back() -> None:
    model = _Net()
    own = model.blocks[0].forward
    model.blocks[0].forward = own  # an instance attribute of the user's
    blocks = CheckpointedModules("_Block")
    blocks.install(model)
    assert model.blocks[0].forward is not own
    blocks.remove()
    assert vars(model.blocks[0])["forward"] is own


class _Module(LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.net = _Net(width=64)
        self.fail_at = fail_at

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("boom")
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*_data(128)), batch_size=32)


def _trainer(callback: ActivationCompression, steps: int = 6) -> Trainer:
    return Trainer(
        callbacks=[callback], max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip


@pytest.mark.parametrize("policy", ["acgc", "fixed"])
def test_callback_checkpoints_during_the_fit_and_restores(policy: str) -> None:
    module = _Module()
    callback = ActivationCompression(
        policy, checkpoint_modules="_Block", min_numel=0, print_table=False
    )
    seen: list[bool] = []
    module.net.blocks[0].register_forward_pre_hook(
        lambda m, args: seen.append("forward" in vars(m))
    )
    _trainer(callback).fit(module)
    assert seen and all(seen)  # every training forward ran the wrapper
    assert all("forward" not in vars(b) for b in module.net.blocks)
    assert callback.stats.saved_bytes > 0


def test_callback_restores_forward_after_an_exception() -> None:
    module = _Module(fail_at=2)
    callback = ActivationCompression("fixed", checkpoint_modules=["_Block"], min_numel=0)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(callback).fit(module)
    assert all("forward" not in vars(b) for b in module.net.blocks)


def test_callback_with_no_matching_module_fails_at_fit_start_and_cleans_up() -> None:
    module = _Module()
    callback = ActivationCompression("fixed", checkpoint_modules="BertLayer")
    with pytest.raises(ValueError, match="matches no module"):
        _trainer(callback).fit(module)
    assert callback.engine is None or not callback.engine.installed


def test_policy_sees_the_block_inputs_as_checkpoint_inputs() -> None:
    policy = _Seen()
    callback = ActivationCompression(policy, checkpoint_modules="_Block", min_numel=0)
    _trainer(callback, steps=2).fit(_Module())
    assert policy.checkpoint_inputs >= 2 * 3  # three blocks' inputs, each step
