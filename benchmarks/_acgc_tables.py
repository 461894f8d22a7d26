"""README's table and bars of ``benchmarks/acgc_vs_fixed.py``: acgc with ``gradient_error``
set to each fixed setting's measured error, beside that setting (issue 13's bar: within
the error, at >= 95% of the setting's ratio), quick and full mode side by side."""

from __future__ import annotations

from typing import Any

__all__ = ["RATIO_SHARE_BAR", "acgc_vs_fixed_bars", "acgc_vs_fixed_table"]

RATIO_SHARE_BAR = 0.95  # acgc at a fixed setting's error keeps this share of its ratio
SETTINGS = {"quant2": "fixed quant 2-bit", "quant4": "fixed quant 4-bit", "gact": "gact"}
DEFAULTS = {"acgc_default": "", "acgc_default_no_probes": ", probes=0 (off)"}  # label suffix


def _rows(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(model description, setting, its measurement, acgc's at its error) per setting;
    acgc's entry holds its global-promise-only measurement as ``global_only`` where run."""
    rows = []
    for info in result["models"].values():
        for key, label in SETTINGS.items():
            entry = info["results"].get(key)
            if entry:
                acgc = dict(entry["acgc_at_its_error"])
                if "acgc_global_only" in entry:
                    acgc["global_only"] = entry["acgc_global_only"]
                rows.append((info["description"], label, entry["baseline"], acgc))
    return rows


def _global_cell(acgc: dict[str, Any]) -> str:
    """acgc held to the global promise alone at the same error (``layer_floor=1``)."""
    g = acgc.get("global_only")
    if not g:
        return "–"
    within = "yes" if g["within"] else "no"
    return f"{g['grad_error']:.3f}, {g['ratio']:.1f}x ({100 * g['ratio_share']:.0f}%), {within}"


def _layers_over(row: dict[str, Any]) -> str:
    """Modules whose own relative error is over the setting's error, and the worst one's
    error (``measure`` reads both against the same bound for a setting and for acgc)."""
    over, worst = row.get("layers_over_error"), row.get("layer_grad_error")
    if over is None or worst is None:
        return "–"
    return f"{over} (worst {worst:.2f})"


def acgc_vs_fixed_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    """One row per mode, model and fixed setting; then acgc at its default per model.
    "layers over that error": the modules whose gradient is off by more than the
    setting's error relative to their own (‖ĝ_m − g_m‖ > e‖g_m‖), for the setting, then
    for acgc at that error: the per-layer promise only acgc makes.

    Example:
        >>> run = {"models": {"m": {"description": "M", "results": {
        ...     "quant2": {"baseline": {"grad_error": 0.8, "ratio": 14.2},
        ...                "acgc_at_its_error": {"grad_error": 0.4, "ratio": 11.3,
        ...                                      "ratio_share": 0.795, "within": True,
        ...                                      "calib_errors": [0.01, 0.3],
        ...                                      "layers_over_error": "0/9",
        ...                                      "layer_grad_error": 0.61}},
        ...     "acgc_default": {"grad_error": 0.02, "ratio": 5.1, "within": True}}}}}
        >>> acgc_vs_fixed_table({"full": run})[2].split(" | ")[6:]
        ['11.3x', '80%', 'yes', '–', '0/9 (worst 0.61)', '– |']
    """
    if not runs:
        return ["No results: run `python -m benchmarks.run_all --only acgc_vs_fixed`."]
    lines = [
        "| mode | model | setting | its error | its ratio | acgc at that error: measured "
        "| acgc's ratio | share of the setting's ratio | within "
        "| layers over that error: the setting | acgc "
        "| global promise only: measured, ratio (share), within |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, result in runs.items():
        for model, label, base, acgc in _rows(result):
            calib = acgc.get("calib_errors") or [0.0]
            lines.append(
                f"| {mode} | {model} | {label} | {base['grad_error']:.3f} | {base['ratio']:.1f}x "
                f"| {acgc['grad_error']:.3f} (calibrations ≤ {max(calib):.3f}) "
                f"| {acgc['ratio']:.1f}x | {100 * acgc['ratio_share']:.0f}% "
                f"| {'yes' if acgc['within'] else 'no'} | {_layers_over(base)} "
                f"| {_layers_over(acgc)} | {_global_cell(acgc)} |"
            )
        for info in result["models"].values():
            for key, suffix in DEFAULTS.items():
                d = info["results"].get(key)
                if d:
                    target = d.get("error_target", 0.05)
                    lines.append(
                        f"| {mode} | {info['description']} | acgc default (e={target:g}){suffix} "
                        f"| – | – | {d['grad_error']:.3f}{_worst_layer(d, target)} "
                        f"| {d['ratio']:.1f}x | – | {'yes' if d['within'] else 'no'} "
                        "| – | – | – |"
                    )
    return lines


def _worst_layer(row: dict[str, Any], target: float) -> str:
    """The worst module's error where measured, and whether it kept the per-layer promise."""
    worst = row.get("layer_grad_error")
    if worst is None:
        return ""
    return f" (worst layer {worst:.3f}, {'within' if worst <= target else 'over'} e)"


def acgc_vs_fixed_bars(runs: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(met, not met): per mode, whether acgc at every setting's error measured within it
    and kept >= 95% of its ratio; the worst setting is named, and the range of shares
    acgc keeps when held to the global promise alone (where measured)."""
    met: list[str] = []
    short: list[str] = []
    for mode, result in runs.items():
        rows = _rows(result)
        if not rows:
            continue
        worst = min(rows, key=lambda r: r[3]["ratio_share"] if r[3]["within"] else -1.0)
        ok = all(a["within"] and a["ratio_share"] >= RATIO_SHARE_BAR for *_, a in rows)
        model, label, _, acgc = worst
        glob = [a["global_only"] for *_, a in rows if "global_only" in a]
        held = [g["ratio_share"] for g in glob if g["within"]]
        also = (
            f"; held to the global promise alone, acgc keeps {100 * min(held):.0f}-"
            f"{100 * max(held):.0f}% of the settings' ratios ({len(held)} of {len(glob)} within)"
            if held
            else ""
        )
        (met if ok else short).append(
            f"acgc at each fixed setting's own error ({mode} mode): worst {label} on {model}, "
            f"{100 * acgc['ratio_share']:.0f}% of its ratio, "
            f"{'within' if acgc['within'] else 'over'} its error "
            f"(bar: within, ≥ {100 * RATIO_SHARE_BAR:.0f}%){also}{_layers_note(rows)}"
        )
    return met, short


def _layers_note(rows: list[tuple[str, str, dict[str, Any], dict[str, Any]]]) -> str:
    """How many of their modules the settings and acgc left over that error (the
    per-layer promise, which only acgc makes), summed over the rows that report it.

    Example:
        >>> rows = [("M", "q", {"layers_over_error": "3/9"}, {"layers_over_error": "0/9"})]
        >>> _layers_note(rows)
        '; modules over that error: the settings 3 of 9, acgc 0 of 9'
    """
    counts = [
        (b["layers_over_error"].split("/"), a["layers_over_error"].split("/"))
        for *_, b, a in rows
        if "layers_over_error" in b and "layers_over_error" in a
    ]
    if not counts:
        return ""
    over = sum(int(b[0]) for b, _ in counts)
    held = sum(int(b[1]) for b, _ in counts)
    mine = sum(int(a[0]) for _, a in counts)
    mine_held = sum(int(a[1]) for _, a in counts)
    return f"; modules over that error: the settings {over} of {held}, acgc {mine} of {mine_held}"
