"""ActivationCompression on a single device: lifecycle, logging, invariants, resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _lightning_models import (
    ManualTwoForward,
    ProbePolicy,
    TinyMLP,
    fit,
    module_hook_count,
    saved_tensors_hooks_active,
    trainer_kwargs,
)
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_acgc.codecs import CodecSpec
from lightning_acgc.lightning import (
    CODEC_POLICY,
    DEFAULT_POLICY,
    DEFAULT_POLICY_OPTIONS,
    ActivationCompression,
)
from lightning_acgc.policies import FixedPolicy, available_policies


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def _assert_clean(model: nn.Module, trainer: Trainer) -> None:
    assert module_hook_count(model) == 0
    assert not saved_tensors_hooks_active()
    assert "training_step" not in trainer.strategy.__dict__


# -- construction ------------------------------------------------------------------
def test_default_policy_is_one_constant() -> None:
    assert ActivationCompression().policy.name == DEFAULT_POLICY == "acgc"
    # Naming a codec or a codec option means that codec everywhere (the fixed policy).
    cb = ActivationCompression(codec="quant", bits=4)
    assert cb.policy.name == CODEC_POLICY == "fixed"
    assert cb.policy.config.options == {"bits": 4}
    fixed = ActivationCompression(policy="fixed")
    options = DEFAULT_POLICY_OPTIONS["fixed"]
    assert fixed.policy.config.codec == options["codec"]
    assert fixed.policy.config.options == {"bits": options["bits"]}
    # naming a codec replaces the default options instead of merging with them
    assert ActivationCompression(codec="identity").policy.config.options == {}
    assert ActivationCompression(bits=2).policy.config.options == {"bits": 2}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "nope"}, "policy='nope' is unknown"),
        ({"codec": "nope"}, "codec='nope' is unknown"),
        ({"codec": "quant", "bits": 3}, "bits=3"),
        ({"codec": "quant", "colour": 1}, "does not take"),
        ({"calibrate_every": 0}, "calibrate_every=0"),
        ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
        ({"min_numel": -1}, "min_numel=-1"),
        ({"seed": 1.5}, "seed=1.5"),
        ({"backend": "cuda"}, "backend='cuda'"),
        ({"memory_budget": "2 parsecs"}, "memory_budget='2 parsecs'"),
        ({"memory_budget": 0}, "memory_budget=0"),
        ({"lr_scaling": "linear"}, "set scale_batch_size"),
        ({"scale_batch_size": "bogus"}, "mode='bogus'"),
        ({"scale_batch_size": "power", "lr_scaling": "cubic"}, "lr_scaling='cubic'"),
        ({"policy": "off", "scale_batch_size": "power"}, "policy='off' installs nothing"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationCompression(**kwargs)


def test_policy_instance_takes_no_options() -> None:
    policy = FixedPolicy(CodecSpec("identity"))
    assert ActivationCompression(policy).policy is policy
    with pytest.raises(ValueError, match="Policy instance is already configured"):
        ActivationCompression(policy, bits=2)


def test_state_keys_let_instances_coexist() -> None:
    a, b = ActivationCompression(bits=2), ActivationCompression(bits=8)
    off = ActivationCompression("off")
    assert len({a.state_key, b.state_key, off.state_key}) == 3
    assert ActivationCompression(bits=2).state_key == a.state_key


# -- training ----------------------------------------------------------------------
def test_automatic_optimization_logs_the_engines_numbers() -> None:
    cb = ActivationCompression(codec="quant", bits=2, print_table=False)
    model = TinyMLP()
    trainer = fit(model, [cb], max_epochs=2)
    stats = cb.stats
    assert stats is not None and stats.tensors_packed > 0
    metrics = trainer.callback_metrics
    assert metrics["acgc/ratio"].item() == pytest.approx(stats.ratio, rel=1e-6)
    assert metrics["acgc/saved_mb"].item() == pytest.approx(stats.saved_bytes / 2**20, rel=1e-6)
    assert metrics["acgc/packed_mb"].item() == pytest.approx(stats.packed_bytes / 2**20, rel=1e-6)
    assert stats.ratio > 3
    assert "acgc/ratio" in trainer.progress_bar_metrics
    assert stats.sites["net.1:0"].codec == "quant"
    _assert_clean(model, trainer)


def test_manual_optimization_compresses_both_forwards() -> None:
    cb = ActivationCompression(codec="quant", bits=4, min_numel=0, print_table=False)
    model = ManualTwoForward(batch_size=32)
    trainer = fit(model, [cb], max_steps=3, max_epochs=5)
    sites = cb.stats.sites
    # one step, two forwards: the ReLU saved twice, as sites 0 and 1 of the step
    assert sites["net.1:0"].codec == "quant" and sites["net.1:1"].codec == "quant"
    assert trainer.callback_metrics["acgc/ratio"] > 1
    assert trainer.global_step == 3
    _assert_clean(model, trainer)


def test_gradient_accumulation_and_exact_gradient_leave_no_trace() -> None:
    """Identity codec + a policy that asks for the exact gradient every other step, with
    dropout, BatchNorm and accumulation: the exact gradient equals p.grad (same dropout
    masks), and the trained weights equal a run without the callback."""
    kwargs = dict(max_epochs=2, accumulate_grad_batches=2)
    torch.manual_seed(0)
    plain = TinyMLP(dropout=0.3, batchnorm=True)
    fit(plain, **kwargs)

    policy = ProbePolicy(CodecSpec("identity"), exact_every=2)
    cb = ActivationCompression(policy, print_table=False)
    torch.manual_seed(0)
    model = TinyMLP(dropout=0.3, batchnorm=True)
    trainer = fit(model, [cb], **kwargs)

    assert trainer.global_step == 4  # 64 samples / 16 per batch / 2 accumulated, 2 epochs
    begins = [arg for name, arg in policy.calls if name == "begin"]
    ends = [arg for name, arg in policy.calls if name == "end"]
    assert begins == ends == [0, 1, 2, 3]
    assert policy.calls[0] == ("setup", "TinyMLP") and policy.calls[-1] == ("teardown", None)
    # steps 0 and 2 calibrate: the exact gradient summed over the step's 2 batches is
    # handed over once, before the second batch's forward; the step's compressed
    # gradient as read on its last batch, before end_step
    assert [c for c in policy.calls if c[0] != "setup"][:5] == [
        ("begin", 0),
        ("exact", 6),  # parameters: two Linear, one BatchNorm
        ("step gradients", 6),
        ("end", 0),
        ("begin", 1),
    ]
    assert sum(name == "exact" for name, _ in policy.calls) == 2
    assert len(policy.max_diff) == 2 and max(policy.max_diff) < 1e-6
    # identity codec: the last batch's gradient (.grad less the first batch's) is its
    # exact one, so the step's as read there is the exact sum
    assert len(policy.step_diff) == 2 and max(policy.step_diff) < 1e-6
    assert trainer.callback_metrics["acgc/probe"] == 1.5
    _assert_same_weights(plain, model)


def test_manual_optimization_skips_the_exact_gradient_with_a_warning() -> None:
    policy = ProbePolicy(CodecSpec("identity"), exact_every=1)
    cb = ActivationCompression(policy, print_table=False)
    with pytest.warns(UserWarning, match="needs automatic optimization"):
        fit(ManualTwoForward(batch_size=32), [cb], max_steps=2)
    assert not any(name == "exact" for name, _ in policy.calls)
    assert [arg for name, arg in policy.calls if name == "end"] == [0, 1]


def test_bf16_mixed_precision() -> None:
    cb = ActivationCompression(codec="quant", bits=4, print_table=False)
    model = TinyMLP()
    trainer = fit(model, [cb], max_steps=3, precision="bf16-mixed")
    rec = cb.stats.sites["net.1:0"]
    assert rec.dtype == "bfloat16" and rec.codec == "quant"
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    _assert_clean(model, trainer)


def test_fast_dev_run() -> None:
    cb = ActivationCompression(print_table=False)
    model = TinyMLP()
    trainer = Trainer(
        callbacks=[cb],
        fast_dev_run=True,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    assert cb.stats.tensors_packed > 0
    _assert_clean(model, trainer)


@pytest.mark.parametrize("kwargs", [{"policy": "off"}, {"codec": "identity"}])
def test_off_and_identity_train_bit_identically(kwargs: dict) -> None:
    run = dict(max_epochs=2, limit_val_batches=1)
    torch.manual_seed(0)
    plain = TinyMLP(dropout=0.2, batchnorm=True)
    fit(plain, **run)
    cb = ActivationCompression(print_table=False, **kwargs)
    torch.manual_seed(0)
    model = TinyMLP(dropout=0.2, batchnorm=True)
    trainer = fit(model, [cb], **run)
    _assert_same_weights(plain, model)
    if kwargs.get("policy") == "off":
        assert cb.engine is None and "acgc/ratio" not in trainer.callback_metrics
    else:  # identity: the control, every tensor counted and kept as it is
        assert cb.stats.sites and cb.stats.ratio == 1.0


def test_validation_is_not_compressed() -> None:
    cb = ActivationCompression(print_table=False)
    model = TinyMLP(probe_validation=True)
    fit(model, [cb], max_epochs=1, limit_val_batches=2)
    assert model.validation_saw_hooks == [False, False]
    assert cb.stats.tensors_packed > 0


# -- cleanup -----------------------------------------------------------------------
def test_nothing_remains_after_an_exception() -> None:
    policy = ProbePolicy(CodecSpec("quant", {"bits": 2}))
    cb = ActivationCompression(policy, print_table=False)
    model = TinyMLP(raise_at_step=2)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(max_epochs=1))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model)
    _assert_clean(model, trainer)
    assert policy.calls[-1] == ("teardown", None)
    # a plain forward/backward afterwards packs nothing
    packed = cb.stats.tensors_packed
    model(torch.randn(8, 32)).sum().backward()
    assert cb.stats.tensors_packed == packed


def test_two_trainers_do_not_interfere() -> None:
    cb2 = ActivationCompression(codec="quant", bits=2, print_table=False)
    cb8 = ActivationCompression(codec="quant", bits=8, print_table=False)
    m2, m8 = TinyMLP(), TinyMLP(hidden=128)
    t2 = Trainer(callbacks=[cb2], **trainer_kwargs(max_steps=2))
    t8 = Trainer(callbacks=[cb8], **trainer_kwargs(max_steps=2))
    t2.fit(m2)
    t8.fit(m8)
    assert cb2.stats.sites["net.1:0"].settings.startswith("bits=2")
    assert cb8.stats.sites["net.1:0"].settings.startswith("bits=8")
    assert cb2.stats.sites["net.1:0"].shape == (16, 256)
    assert cb8.stats.sites["net.1:0"].shape == (16, 128)
    assert cb2.stats.ratio > cb8.stats.ratio
    assert t2.callback_metrics["acgc/ratio"] != t8.callback_metrics["acgc/ratio"]
    # the same callback instance can serve another fit, with fresh hooks
    t2b = Trainer(callbacks=[cb2], **trainer_kwargs(max_steps=1))
    t2b.fit(TinyMLP())
    for model, trainer in ((m2, t2), (m8, t8), (m2, t2b)):
        _assert_clean(model, trainer)


def test_one_active_compression_per_trainer() -> None:
    both = [ActivationCompression(bits=2), ActivationCompression(bits=8)]
    with pytest.raises(MisconfigurationException, match="one ActivationCompression per Trainer"):
        fit(TinyMLP(), both, max_steps=1)
    active, off = ActivationCompression(bits=2, print_table=False), ActivationCompression("off")
    fit(TinyMLP(), [active, off], max_steps=1)
    assert active.stats.tensors_packed > 0


def test_table_printed_at_fit_end(caplog: pytest.LogCaptureFixture) -> None:
    cb = ActivationCompression(codec="quant", bits=4)
    with caplog.at_level("INFO"):
        fit(TinyMLP(), [cb], max_steps=1)
    assert "net.1:0" in caplog.text and "bits=4" in caplog.text and "MB before" in caplog.text


# -- checkpoint and resume -----------------------------------------------------------
@pytest.mark.parametrize(
    "policy_options",
    [
        {"codec": "quant", "bits": 2},
        # calibrating policy: bounds, corrections and histories come back with the state
        {"policy": "acgc", "gradient_error": 0.05, "calibrate_every": 3},
    ],
    ids=["fixed-quant2", "acgc"],
)
def test_resume_at_epoch_boundary_matches_uninterrupted_run(
    tmp_path: Any, policy_options: dict
) -> None:
    options = dict(**policy_options, seed=7, print_table=False)
    torch.manual_seed(0)
    full = TinyMLP()
    fit(full, [ActivationCompression(**options)], max_epochs=4)

    torch.manual_seed(0)
    first = TinyMLP()
    t1 = fit(first, [ActivationCompression(**options)], max_epochs=2)
    ckpt = tmp_path / "epoch2.ckpt"
    t1.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    (saved,) = (v for k, v in state.items() if k.startswith("ActivationCompression"))
    assert saved["step"] == 8 and saved["seed"] == 7  # 4 batches per epoch

    resumed = TinyMLP()
    cb = ActivationCompression(**options)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(max_epochs=4))
    trainer.fit(resumed, ckpt_path=ckpt)
    _assert_same_weights(full, resumed)

    # the restored step counter matters: restarting the seeds from step 0 diverges
    fresh = TinyMLP()
    cb = ActivationCompression(**options)
    trainer = Trainer(callbacks=[cb], **trainer_kwargs(max_epochs=4))
    cb.load_state_dict = lambda state: None  # type: ignore[method-assign]
    trainer.fit(fresh, ckpt_path=ckpt)
    assert not torch.equal(fresh.net[0].weight, full.net[0].weight)


@pytest.mark.skipif("acgc" not in available_policies(), reason="no 'acgc' policy registered")
def test_calibrating_policy_gets_exact_gradients_and_logs_its_metrics() -> None:
    cb = ActivationCompression("acgc", gradient_error=0.1, calibrate_every=2, print_table=False)
    assert cb.policy.calibrate_every == 2  # passed on because its constructor takes it
    trainer = fit(TinyMLP(), [cb], max_epochs=2, accumulate_grad_batches=2)
    error = trainer.callback_metrics["acgc/grad_error"]
    assert torch.isfinite(error) and error > 0
    assert cb.policy.site_settings()
