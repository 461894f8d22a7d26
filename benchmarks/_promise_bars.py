"""The bars read off ``benchmarks/promise.py``'s fits: acgc's promise over whole fits and
how much of its budget its calibrations use (issue 13)."""

from __future__ import annotations

from typing import Any

__all__ = ["BAND", "PROMISE_BAR", "band_bar", "promise_bar"]

BAND = (0.5, 1.0)  # the share of e a calibration's measured error should land in
PROMISE_BAR = 0.99  # share of a fit's verified calibrations that keep acgc's promise


def promise_bar(promise: dict[str, Any]) -> tuple[bool, str]:
    """acgc's promise over whole fits (``benchmarks/promise.py``): (met, its line).

    Example:
        >>> promise_bar({"calibrate_every": 5, "summary": {
        ...     "charlm": {"calibrations": 10, "kept": 9, "share": 0.9, "worst_layer": 1.4},
        ...     "all": {"calibrations": 10, "kept": 9, "share": 0.9, "worst_layer": 1.4}}})[0]
        False
        >>> s = {"calibrations": 10, "kept": 10, "share": 1.0, "worst_layer": 0.9,
        ...      "held_out_checks": 8, "held_out_kept": 7}
        >>> met, line = promise_bar({"calibrate_every": 5, "summary": {"a": s, "all": s}})
        >>> met, "allocated on: 7 of 8)" in line
        (True, True)
    """
    summary = promise["summary"]
    s = summary["all"]
    each = ", ".join(
        f"{r} {v['kept']}/{v['calibrations']}" for r, v in summary.items() if r != "all"
    )
    step = ""
    if "layer_step_kept" in s:  # every layer also within e_m of its step's own ‖g_m‖
        step = f"; against each step's own ‖g_m‖ alone: {s['layer_step_kept']}"
    if s.get("held_out_checks"):  # the step after each calibration (benchmarks/_held_out.py)
        step += (
            f"; on the step after each calibration, its settings on a batch they were not "
            f"allocated on: {s['held_out_kept']} of {s['held_out_checks']}"
        )
    share = s["kept"] / s["calibrations"]  # (the stored share is rounded: 281/282 read 99.7%)
    return share >= PROMISE_BAR, (
        f"acgc's promise over whole fits (the sweep's recipes at the default e, calibrating "
        f"every {promise['calibrate_every']} steps): both the global error ≤ e and every "
        f"layer within its e_m on {s['kept']} of {s['calibrations']} verified calibrations "
        f"({100 * share:.1f}%: {each}; worst layer {s['worst_layer']:.2f}x its bound"
        f"{step}) (bar: ≥ {100 * PROMISE_BAR:g}%)"
    )


def band_bar(promise: dict[str, Any]) -> tuple[bool, str]:
    """How much of its budget acgc's calibrations use (``benchmarks/promise.py``): met
    when the median calibration's global error lies in [0.5e, e].

    Example:
        >>> summary = {"calibrations": 10, "global_in_band": 2, "layer_in_band": 7,
        ...            "median_global": 0.3, "median_layer": 0.6}
        >>> met, line = band_bar({"summary": {"a": summary, "all": summary}})
        >>> met, "global error on 2 of 10" in line, "worst layer's against its e_m on 7" in line
        (False, True, True)
    """
    summary = promise["summary"]
    s = summary["all"]
    low, high = BAND
    band = f"[{low:g}e, e]" if high == 1 else f"[{low:g}e, {high:g}e]"

    def each(kind: str) -> str:
        return ", ".join(f"{r} {v[f'median_{kind}']:.2f}" for r, v in summary.items() if r != "all")

    if s.get("median_global") is None:
        return False, f"acgc's measured error in {band}: no verified calibration"
    return low <= s["median_global"] <= high, (
        f"acgc's measured error in {band} (the sweep's fits at the default e):"
        f" the global error on {s['global_in_band']} of {s['calibrations']} verified"
        f" calibrations (median {s['median_global']:.2f}e; per recipe {each('global')}),"
        f" the worst layer's against its e_m on {s['layer_in_band']}"
        f" (median {s['median_layer']:.2f}; {each('layer')})"
        f" (bar: the median calibration's global error in {band})"
    )
