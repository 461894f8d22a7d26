"""README's table of ``benchmarks/margin.py``: per acgc margin (``target``), its share of
the fixed settings' ratios at their errors, its default's ratio, how many verified
calibrations of whole fits kept the promise, and how much of their bound they used."""

from __future__ import annotations

from typing import Any

__all__ = ["margin_table"]

SETTINGS = ("quant2", "quant4", "gact")


def _shares(rows: dict[str, Any]) -> str:
    """acgc's share of each setting's ratio at its error; "(over)" where it measured over."""
    cells = []
    for key in SETTINGS:
        row = rows.get(key)
        if row:
            cells.append(f"{100 * row['ratio_share']:.0f}%{'' if row['within'] else ' (over)'}")
    return " / ".join(cells) or "–"


def margin_table(result: dict[str, Any] | None) -> list[str]:
    """One row per target: per model acgc's share of fixed 2-bit's / 4-bit's / gact's
    ratio, its default's ratio per model, and over the fits the calibrations that kept
    the global promise, the per-layer one (per recipe), the fits' median ratios, and
    (where measured) how many checks of the step after each calibration kept both
    promises and the median calibration's global error and worst layer's use.

    Example:
        >>> row = {"ratio_share": 0.9, "within": True}
        >>> result = {"targets": [0.35], "default_target": 0.35, "models": {"gnn": {
        ...     "description": "G",
        ...     "acgc": {"0.35": {"quant2": row, "acgc_default": {"ratio": 9.5}}}}},
        ...     "fits": {"0.35": {"gnn": {"calibrations": 8, "global_kept": 8,
        ...     "layer_kept": 7, "kept": 7, "ratio": 8.8}, "all": {"calibrations": 8,
        ...     "global_kept": 8, "layer_kept": 7, "kept": 7}}}}
        >>> margin_table(result)[2]
        '| 0.35 (default) | 90% | 9.5x | 8/8 | 7/8 (gnn 7/8) | gnn 8.8x |'
        >>> result["fits"]["0.35"]["all"].update(median_global=0.33, median_layer=0.49)
        >>> margin_table(result)[2].split(" | ")[-1]
        '0.33e / 0.49 |'
        >>> result["fits"]["0.35"]["all"].update(held_out_checks=6, held_out_kept=5)
        >>> margin_table(result)[2].split(" | ")[-2:]
        ['5/6', '0.33e / 0.49 |']
    """
    if not result:
        return ["No results: run `python -m benchmarks.run_all --only margin`."]
    models = result["models"]
    names = list(models)
    header = [
        "target",
        *(f"{n}: share of 2-bit's / 4-bit's / gact's ratio" for n in names),
        f"default's ratio ({', '.join(names)})",
        "fits: global promise kept",
        "per-layer promise kept",
        "fits' median ratio",
    ]
    fits_all = [f.get("all", {}) for f in result.get("fits", {}).values()]
    held = any("held_out_checks" in f for f in fits_all)
    if held:
        header.append("the step after: both promises kept")
    banded = any("median_global" in f for f in fits_all)
    if banded:
        header.append("median calibration: global error / worst layer's use of its bound")
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for target in result["targets"]:
        key = str(target)
        shares = [_shares(models[n]["acgc"].get(key, {})) for n in names]
        defaults = ", ".join(
            f"{models[n]['acgc'][key]['acgc_default']['ratio']:.1f}x"
            for n in names
            if "acgc_default" in models[n]["acgc"].get(key, {})
        )
        fits = result.get("fits", {}).get(key, {})
        whole = fits.get("all")
        recipes = [(r, s) for r, s in fits.items() if r != "all"]
        if whole:
            n = whole["calibrations"]
            per_recipe = ", ".join(f"{r} {s['layer_kept']}/{s['calibrations']}" for r, s in recipes)
            cells = [
                f"{whole['global_kept']}/{n}",
                f"{whole['layer_kept']}/{n} ({per_recipe})",
                ", ".join(f"{r} {s['ratio']:.1f}x" for r, s in recipes),
            ]
        else:
            cells = ["–", "–", "–"]
        if held:
            cells.append(
                f"{whole['held_out_kept']}/{whole['held_out_checks']}"
                if whole and "held_out_checks" in whole
                else "–"
            )
        if banded:
            cells.append(
                f"{whole['median_global']:.2f}e / {whole['median_layer']:.2f}"
                if whole and "median_global" in whole
                else "–"
            )
        label = f"{target:g}{' (default)' if target == result.get('default_target') else ''}"
        lines.append(f"| {label} | " + " | ".join([*shares, defaults or "–", *cells]) + " |")
    return lines
