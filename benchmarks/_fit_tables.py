"""README's fit-time table and the fit-time bar, from ``benchmarks/fit_time.py``'s line."""

from __future__ import annotations

from typing import Any

from benchmarks._tables import FIT_TIME_BAR, _name

__all__ = ["fit_time_bars", "fit_time_table"]


def fit_time_table(result: dict[str, Any] | None) -> list[str]:
    """One row per model: plain's step, acgc's step and fit as multiples of it.

    Example:
        >>> row = {"step_s": 2.6, "grad_s": 2.2, "optimizer_s": 0.4, "step_vs_plain": 1.2,
        ...        "grad_vs_plain": 1.24, "calibration_step_s": 9.1, "calibrate_every": 100,
        ...        "fit_vs_plain": 1.23, "first_calibrations_extra_s": 20.0,
        ...        "fit_1000_vs_plain": 1.24}
        >>> model = {"description": "BERT 12x768", "optimizer": "AdamW",
        ...          "plain": {"step_s": 2.2, "grad_s": 1.8, "optimizer_s": 0.4}, "acgc": row}
        >>> fit_time_table({"commit": "abc", "models": {"bert_base": model}})[2].split(" | ")[2:]
        ['2.20 s (1.80 + 0.40)', '1.24x', '1.20x', '9.10 s', '1.23x', '+20.0 s', '1.24x', 'abc |']
    """
    if not result:
        return []
    every = next(iter(result["models"].values()))["acgc"]["calibrate_every"]
    rows = [
        "| model | optimizer | plain step (forward + backward + optimizer) | acgc: forward + "
        "backward vs plain | whole step vs plain | calibration step | fit vs plain, one "
        f"calibration per {every} steps | first three calibrations, one-time | fit of "
        "1,000 steps vs plain | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for info in result["models"].values():
        p, a = info["plain"], info["acgc"]
        rows.append(
            f"| {info['description']} | {info['optimizer']} | {p['step_s']:.2f} s "
            f"({p['grad_s']:.2f} + {p['optimizer_s']:.2f}) | {a['grad_vs_plain']:.2f}x | "
            f"{a['step_vs_plain']:.2f}x | {a['calibration_step_s']:.2f} s | "
            f"{a['fit_vs_plain']:.2f}x | +{a['first_calibrations_extra_s']:.1f} s | "
            f"{a['fit_1000_vs_plain']:.2f}x | {info.get('commit', result.get('commit'))} |"
        )
    return rows


def fit_time_bars(result: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """The fit-time bar (≤ ``FIT_TIME_BAR`` at full size on CPU), per model of a full CPU
    line: (met, not met)."""
    met: list[str] = []
    short: list[str] = []
    if not result or result.get("mode") != "full" or result["machine"]["device"] != "cpu":
        return met, short
    for model, info in result["models"].items():
        a = info["acgc"]
        line = (
            f"fit time of {_name(model)} with acgc (`benchmarks/fit_time.py`: plain and acgc "
            f"alone, alternating, each step with its {info['optimizer']} step; one "
            f"calibration each {a['calibrate_every']} steps): {a['fit_vs_plain']:.2f}x plain, "
            f"{a['fit_1000_vs_plain']:.2f}x over a 1,000-step fit with its first three "
            f"calibrations (bar ≤ {FIT_TIME_BAR:g}x at full size on CPU)"
        )
        (met if a["fit_vs_plain"] <= FIT_TIME_BAR else short).append(line)
    return met, short
