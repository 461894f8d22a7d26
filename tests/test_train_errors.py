"""``recipes/train.py`` says which compression config takes an option given without
it, instead of Hydra's ``Key 'gradient_error' is not in struct``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recipes.train import compression_option_hint

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["compression.gradient_error=0.1"], "use compression=acgc compression.gradient_error=0.1"),
        (
            ["compression=fixed", "compression.gradient_error=0.1"],
            "compression=fixed has no option 'gradient_error'; use compression=acgc",
        ),
        (["compression.bits=2"], "use compression=fixed compression.bits=2 or compression=gact"),
        (["compression=acgc", "compression.gradient_eror=0.1"], "no compression config takes"),
    ],
)
def test_hint_names_the_config_that_takes_the_option(overrides: list[str], expected: str) -> None:
    hint = compression_option_hint(overrides)
    assert hint is not None and expected in hint


@pytest.mark.parametrize(
    "overrides",
    [
        ["compression=acgc", "compression.gradient_error=0.1"],
        ["compression=gact", "compression.bits=3"],
        ["compression=none"],
        ["experiment=bert_text_acgc", "compression.gradient_error=0.1"],
        ["-m", "compression=none,acgc"],
        ["model=bert", "trainer.max_epochs=1"],
    ],
)
def test_no_hint_for_valid_overrides(overrides: list[str]) -> None:
    assert compression_option_hint(overrides) is None


def test_command_line_error_says_what_to_do() -> None:
    run = subprocess.run(
        [sys.executable, "recipes/train.py", "compression.gradient_error=0.1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode != 0
    assert "use compression=acgc compression.gradient_error=0.1" in run.stderr
    assert "not in struct" not in run.stderr
