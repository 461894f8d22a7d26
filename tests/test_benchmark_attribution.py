"""benchmarks/attribution.py: one calibration's error, one class of stored tensors at a
time: the whole run is acgc's own calibration, and a class alone compresses only it."""

from __future__ import annotations

import pytest

from benchmarks.attribution import attribute, fit_to_step
from benchmarks.promise import fit_with_acgc
from lightning_acgc.policies.acgc_probes import tensor_class


@pytest.mark.slow
def test_with_every_class_the_step_reads_what_acgc_reads() -> None:
    whole = fit_to_step("gnn", seed=0, step=5, only=None)
    fit = fit_with_acgc("gnn", seed=0, calibrate_every=5)
    fourth = 3  # calibrations at steps 0, 1, 2 (warm-up), then 5
    assert whole["global"] == pytest.approx(fit["global_use"][fourth], abs=1e-3)
    assert whole["worst_layer"] == pytest.approx(fit["layer_use"][fourth], abs=1e-3)


def test_a_class_alone_is_all_that_is_encoded_on_that_step() -> None:
    result = attribute("gnn", seed=0, step=5)
    assert len(result["classes"]) >= 2
    every = [k for entry in result["classes"] for k in entry["settings"]]
    for entry in result["classes"]:
        assert entry["encoded"], entry["class"]
        assert {tensor_class(k) for k in entry["encoded"]} == {entry["class"]}
        assert set(entry["encoded"]) <= set(entry["settings"])
    assert len(every) == len(set(every))
    assert result["classes_global"] > 0


def test_a_step_that_does_not_calibrate_is_refused() -> None:
    with pytest.raises(ValueError, match="step=4 is not a calibration step"):
        fit_to_step("gnn", seed=0, step=4, only=None)
