"""The Hydra configs in ``configs/``: every option composes and instantiates, overrides
work as users expect, and bad overrides fail before anything trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import lightning_acgc
from lightning_acgc.policies import available_policies
from recipes.config_schema import CONFIG_DIR, compose_config
from recipes.models import Classifier

REPO = CONFIG_DIR.parent

# The model config that goes with each data config.
MODEL_FOR_DATA = {
    "digits": "resnet",
    "cifar10": "resnet",
    "text": "bert",
    "glue": "bert",
    "sbm": "gnn",
    "cora": "gnn",
    "pytext": "charlm",
}


def options(group: str) -> list[str]:
    """The options of a config group: the YAML files directly in ``configs/<group>/``."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def compression_skip_reason(cfg: DictConfig) -> str | None:
    """Why ``cfg.compression`` cannot be built in this install yet (``None``: it can)."""
    if cfg.compression is None:
        return None
    if not hasattr(lightning_acgc, "ActivationCompression"):
        return "lightning_acgc.ActivationCompression is not exported yet"
    if cfg.compression.policy not in available_policies():
        return f"policy {cfg.compression.policy!r} is not registered yet"
    return None


def test_groups_hold_the_expected_options() -> None:
    assert options("compression") == ["acgc", "comet", "division", "fixed", "gact", "none"]
    assert {"bert", "charlm", "gnn", "resnet"} <= set(options("model"))  # and the size presets
    assert options("data") == sorted(MODEL_FOR_DATA)
    assert options("trainer") == ["default", "fast"]
    assert options("experiment"), "experiment/ holds no overlays"


def test_default_config_is_resnet_on_digits_without_compression() -> None:
    cfg = compose_config()
    assert cfg.model._target_ == "recipes.models.ResNetClassifier"
    assert cfg.data._target_ == "recipes.data.DigitsDataModule"
    assert cfg.compression is None
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


@pytest.mark.parametrize("data", options("data"))
def test_data_option_instantiates(data: str) -> None:
    cfg = compose_config([f"model={MODEL_FOR_DATA[data]}", f"data={data}"])
    datamodule = instantiate(cfg.data)  # no setup(): nothing is generated or downloaded
    assert isinstance(datamodule, pl.LightningDataModule)


@pytest.mark.parametrize("model", options("model"))
def test_model_option_instantiates(model: str) -> None:
    cfg = compose_config([f"model={model}"])
    module = instantiate(cfg.model)
    assert isinstance(module, Classifier)
    assert module.num_classes == cfg.data.num_classes


@pytest.mark.parametrize("trainer", options("trainer"))
def test_trainer_option_instantiates(trainer: str, tmp_path: Path) -> None:
    cfg = compose_config([f"trainer={trainer}"])
    built = instantiate(cfg.trainer, logger=False, default_root_dir=str(tmp_path))
    assert isinstance(built, pl.Trainer)
    assert built.max_epochs == cfg.trainer.max_epochs


@pytest.mark.parametrize("compression", options("compression"))
def test_compression_option_instantiates(compression: str) -> None:
    cfg = compose_config([f"compression={compression}"])
    if compression == "none":
        assert cfg.compression is None
        return
    assert cfg.compression.policy == compression
    reason = compression_skip_reason(cfg)
    if reason:
        pytest.skip(reason)
    callback = instantiate(cfg.compression)
    assert isinstance(callback, lightning_acgc.ActivationCompression)
    assert callback.policy.name == compression


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_overlay_composes(experiment: str) -> None:
    text = (CONFIG_DIR / "experiment" / f"{experiment}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    assert f"python recipes/train.py experiment={experiment}" in text, "no command in the header"
    cfg = compose_config([f"experiment={experiment}"])
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    instantiate(cfg.data)
    instantiate(cfg.model)
    if cfg.compression is not None and compression_skip_reason(cfg) is None:
        instantiate(cfg.compression)


_KEY_LINE = re.compile(r"^\s*[\w.@/]+:\s*\S")


@pytest.mark.parametrize(
    "path",
    sorted(CONFIG_DIR.rglob("*.yaml")),
    ids=lambda p: str(p.relative_to(CONFIG_DIR)),
)
def test_every_field_is_commented(path: Path) -> None:
    in_defaults = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("defaults:"):
            in_defaults = True
            continue
        if in_defaults and line.startswith("  - "):
            continue
        in_defaults = False
        if _KEY_LINE.match(line):
            assert "#" in line, f"{path.name}:{n} has no comment: {line!r}"


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    [
        (["model=bert", "compression=acgc", "compression.gradient_error=0.02"],
         "compression.gradient_error", 0.02),
        (["compression=gact", "compression.bits=3"], "compression.bits", 3.0),
        (["compression=fixed", "compression.bits=2"], "compression.bits", 2),
        (["compression=none"], "compression", None),
        (["model=bert"], "data._target_", "recipes.data.SyntheticTextDataModule"),
        (["model=bert", "data=glue"], "data._target_", "recipes.data.GlueDataModule"),
        (["data=glue", "model=bert"], "data._target_", "recipes.data.GlueDataModule"),
        (["model=gnn"], "data._target_", "recipes.data.SBMGraphDataModule"),
        (["model=gnn", "data=cora"], "model.in_channels", 1433),
        (["model=resnet", "data=cifar10"], "model.in_channels", 3),
        (["model=bert", "data.num_classes=4"], "model.num_classes", 4),
        (["experiment=bert_text_acgc"], "compression.gradient_error", 0.05),
        (["experiment=bert_text_acgc", "compression.gradient_error=0.1"],
         "compression.gradient_error", 0.1),
        (["experiment=gnn_sbm_gat_acgc", "compression=gact"], "compression.policy", "gact"),
        (["seed=7"], "data.seed", 7),
        (["compression=fixed", "+compression.group_size=64"], "compression.group_size", 64),
        (["+trainer.gradient_clip_algorithm=value"], "trainer.gradient_clip_algorithm", "value"),
    ],
)  # fmt: skip
def test_overrides_work_as_users_expect(overrides: list[str], key: str, expected: object) -> None:
    cfg = compose_config(overrides)
    value = OmegaConf.select(cfg, key)
    assert value == expected
    assert type(value) is type(expected)


def _messages(err: BaseException | None) -> str:
    """The messages of an exception and its causes, as Hydra prints them."""
    parts = []
    while err is not None:
        parts.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(parts)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["compression=nonexistent"], r"Could not find 'compression/nonexistent'"),
        (["model=transformer"], r"Could not find 'model/transformer'"),
        (["compression=acgc", "compression.gradient_error=abc"], r"could not be converted"),
        (["compression=acgc", "compression.gradeint_error=0.02"], r"gradeint_error"),
        (["model.widht=0.5"], r"Key 'widht' not in"),
        (["model.depth=eighteen"], r"could not be converted to Integer"),
        (["compression=none", "compression.bits=2"], r"compression.bits"),
        (["trainer.max_epocs=3"], r"Key 'max_epocs' not in"),
    ],
)
def test_bad_override_fails_at_composition(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(overrides)
    assert re.search(match, _messages(info.value)), _messages(info.value)


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything gets as far as ``Trainer.fit``."""

    def fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started although the config is bad")

    monkeypatch.setattr(pl.Trainer, "fit", fit)


@pytest.mark.parametrize(
    ("overrides", "match", "needs_callback"),
    [
        (["compression=fixed", "compression.bits=3"], r"bits=3", True),
        (["compression=acgc", "compression.gradient_error=2.0"], r"gradient_error=2.0", True),
        (["compression=fixed", "compression.codec=nonexistent"], r"nonexistent", True),
        (["model=bert", "data=digits"], r"Model and data must fit together", False),
        (["model.depth=19"], r"depth=19", False),
        (["model.optimizer=adam"], r"optimizer='adam'", False),
    ],
)
def test_bad_value_fails_before_training(
    overrides: list[str], match: str, needs_callback: bool, no_training: None
) -> None:
    from recipes.train import train

    cfg = compose_config([*overrides, "logger=false"])
    if needs_callback and (reason := compression_skip_reason(cfg)):
        pytest.skip(reason)
    start = time.perf_counter()
    with pytest.raises((ValueError, InstantiationException), match=match):
        train(cfg)
    assert time.perf_counter() - start < 30


def _run_train_py(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_command_line_bad_override_prints_hydra_message(tmp_path: Path) -> None:
    result = _run_train_py("compression=nonexistent", cwd=tmp_path)
    assert result.returncode != 0
    assert "Could not find 'compression/nonexistent'" in result.stderr
    assert "acgc" in result.stderr  # the available options are listed


@pytest.mark.slow
def test_command_line_multirun(tmp_path: Path) -> None:
    cfg = compose_config(["compression=fixed"])
    if reason := compression_skip_reason(cfg):
        pytest.skip(reason)
    result = _run_train_py(
        "-m",
        "compression=none,fixed",
        "model=gnn",
        "data.num_nodes=2000",
        "trainer.fast_dev_run=true",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [s for s in result.stdout.splitlines() if s.startswith("summary:")]
    assert len(lines) == 2, result.stdout[-3000:]
    assert "compression=none" in lines[0] and "compression=fixed" in lines[1]
    assert "acgc/ratio" in lines[1]
