"""The Markdown tables of ``benchmarks/report.py`` and the project's bars checked
against the numbers."""

from __future__ import annotations

import math
from typing import Any

from benchmarks._plots import BAR_POLICY, LABELS, TIME_BAR, family_model
from benchmarks._promise_bars import band_bar, promise_bar

__all__ = [
    "accuracy_table",
    "bars",
    "batch_table",
    "best_policy",
    "family_table",
    "machine_line",
    "memory_time_table",
    "notes",
    "peak_notes",
    "tradeoff_table",
]

MB = 2**20
RATIO_BAR = 20.0  # activation ratio on the ResNet recipe
FIXED_TIME_BAR = 1.20  # fixed 2-bit's step time relative to plain, CPU (issue 14)
FIXED_BAR_CONFIG = "quant2"
FIT_TIME_BAR = 1.30  # acgc's fit time, calibration included, at full size on CPU (issue 13)
ACCURACY_BAR_PP = 0.1  # accuracy within 0.1 pp of plain, or within plain's seed spread
PEAK_GAP = 0.15  # measured step peak within 15% of what the activation ratio predicts
MODEL_NAMES = {"resnet": "ResNet", "bert": "BERT", "gnn": "GNN"}
BEST_ERROR = 0.05  # the best policy: the highest ratio at a measured error up to this
COMBINED = "acgc_checkpoint"  # acgc used together with checkpointing (benchmarks/_harness.py)
CHECKPOINTING = ("checkpoint", COMBINED)  # configurations that checkpoint blocks


def _name(model: str) -> str:
    return MODEL_NAMES.get(model, model)


def machine_line(m: dict[str, Any]) -> str:
    text = (
        f"{m['cpu']}, {m['cpu_count']} cores, {m['platform']}, Python {m['python']}, "
        f"torch {m['torch']}, {m['threads']} thread(s), device {m['device']}"
    )
    if "gpu" in m:
        text += f" ({m['gpu']})"
    text += f", {m['date'][:10]}"
    if "load_avg_1m" in m:
        text += f"; load average {m['load_avg_1m']:g} when the memory benchmark started"
    return text


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def memory_time_table(memory: dict[str, Any] | None, speed: dict[str, Any] | None) -> list[str]:
    if memory is None and speed is None:
        return ["(memory and speed: not run)"]
    described = dict((memory or {}).get("models", {}))  # memory's cases, then speed's own
    for model, info in (speed or {}).get("models", {}).items():
        described.setdefault(model, info)
    out = [
        "| model | configuration | activations saved → kept (MB) | ratio | step peak, measured "
        "(predicted) MB | step time vs plain | gradient error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, info in described.items():
        mem = (memory or {}).get("models", {}).get(model, {}).get("configs", {})
        spd = (speed or {}).get("models", {}).get(model, {}).get("configs", {})
        first = True
        for config in LABELS:
            if config not in mem and config not in spd:
                continue
            m, s = mem.get(config, {}), spd.get(config, {})
            name, first = (info["description"] if first else ""), False
            kept = f"{m['saved_mb']:.2f} → {m['kept_mb']:.2f}" if "kept_mb" in m else "–"
            peak = _fmt(m.get("step_peak_mb", m.get("rss_step_peak_mb")), ".1f")
            if config != "plain" and m.get("predicted_step_peak_mb") is not None:
                peak += f" ({m['predicted_step_peak_mb']:.1f})"
            out.append(
                f"| {name} | {LABELS[config]} | {kept} | "
                f"{_fmt(m.get('ratio'), '.1f', 'x')} | {peak} | "
                f"{_fmt(s.get('vs_plain'), '.2f', 'x')} | {_fmt(m.get('grad_error'), '.3f')} |"
            )
    return out


def accuracy_table(accuracy: dict[str, Any] | None) -> list[str]:
    if accuracy is None:
        return ["(accuracy: not run)"]
    n = len(accuracy["seeds"])
    out = [
        f"| model | configuration | val acc, {n} seeds: mean ± std [min, max] | vs plain "
        f"(pp) | val loss: mean [min, max] | paired loss diff vs plain (± s.e.) | within "
        f"plain's loss spread | ratio (acgc/ratio) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, info in accuracy["models"].items():
        plain = info["configs"]["plain"]
        for i, (config, r) in enumerate(info["configs"].items()):
            delta = 100 * (r["mean"] - plain["mean"])
            loss, diff, within = "–", "–", "–"
            if "loss" in r:  # results from before the losses were recorded have none
                loss = f"{r['loss']['mean']:.4f} [{r['loss']['min']:.4f}, {r['loss']['max']:.4f}]"
                diff = f"{r['loss_diff']:+.4f} ± {r['loss_diff_se']:.4f}"
                width = plain["loss"]["max"] - plain["loss"]["min"]
                within = "yes" if abs(r["loss_diff"]) <= width else "no"
            out.append(
                f"| {_name(model) if i == 0 else ''} | "
                f"{LABELS.get(config, config)} | {100 * r['mean']:.2f} ± {100 * r['std']:.2f} "
                f"[{100 * r['min']:.2f}, {100 * r['max']:.2f}] | {delta:+.2f} | {loss} | "
                f"{diff} | {within} | {r['ratio_mean']:.1f}x |"
            )
    out.append("")
    out += [
        f"{_name(model)}: `python recipes/train.py {' '.join(info['overrides'])}"
        f" compression=<configuration> seed=<seed>`"
        for model, info in accuracy["models"].items()
    ]
    return out


def batch_table(batch: dict[str, Any] | None) -> list[str]:
    if batch is None:
        return ["(batch: not run)"]
    configs = sorted(
        {c for m in batch["models"].values() for c in m["configs"]}, key=list(LABELS).index
    )
    out = [
        "| model | budget (MB) | plain | " + " | ".join(LABELS[c] for c in configs) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in configs) + " |",
    ]
    for info in batch["models"].values():
        plain = next(iter(info["configs"].values()))["batch_size_uncompressed"]
        cells = []
        for config in configs:
            r = info["configs"].get(config)
            cap = " (data cap)" if r and r["capped_by_data"] else ""
            cells.append(f"{r['batch_size']} ({r['gain']:g}x){cap}" if r else "–")
        out.append(
            f"| {info['description']} | {info['budget_mb']:.1f} | {plain} | "
            + " | ".join(cells)
            + " |"
        )
    return out


def tradeoff_table(tradeoff: dict[str, Any] | None) -> list[str]:
    if tradeoff is None:
        return ["(tradeoff: not run)"]
    out = [
        "| allowed error e | measured error: median (max) | within e | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for r in tradeoff["tradeoff"]:
        out.append(
            f"| {r['gradient_error']:g} | {r['grad_error']:.4f} ({r['grad_error_max']:.4f}) | "
            f"{100 * r['within']:.0f}% of {r['steps']} steps | {r['ratio']:.2f}x |"
        )
    return out


def best_policy(configs: dict[str, dict[str, Any]]) -> str | None:
    """The policy with the highest ratio among those whose measured gradient error is at
    most ``BEST_ERROR`` (all policies if none is)."""
    policies = {c: r for c, r in configs.items() if c not in ("plain", *CHECKPOINTING)}
    within = {c: r for c, r in policies.items() if r.get("grad_error", 1.0) <= BEST_ERROR}
    pool = within or policies
    return max(pool, key=lambda c: pool[c]["ratio"]) if pool else None


def family_table(runs: dict[str, tuple[dict[str, Any], dict[str, Any] | None]]) -> list[str]:
    """Per mode and model: the best policy's ratio, error, step time against plain and
    against checkpointing, and the step peak against the prediction."""
    out = [
        f"| mode | model | best policy (error ≤ {BEST_ERROR:g}) | ratio | gradient error | "
        "step time vs plain | vs checkpoint (its ratio, time) | step peak vs predicted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, (memory, speed) in runs.items():
        for model, info in memory["models"].items():
            mem = info["configs"]
            best = best_policy(mem)
            if best is None:
                continue
            spd = (speed or {}).get("models", {}).get(model, {}).get("configs", {})
            r, ck = mem[best], mem.get("checkpoint", {})
            t, ck_t = spd.get(best, {}).get("vs_plain"), spd.get("checkpoint", {}).get("vs_plain")
            vs_ck = f"{_fmt(ck.get('ratio'), '.1f', 'x')}, {_fmt(ck_t, '.2f', 'x')}" if ck else "–"
            gap = r.get("peak_vs_predicted")
            out.append(
                f"| {mode} | {info['description']} | {LABELS.get(best, best)} | "
                f"{r['ratio']:.1f}x | {_fmt(r.get('grad_error'), '.3f')} | "
                f"{_fmt(t, '.2f', 'x')} | {vs_ck} | {_fmt(gap, '.2f', 'x')} |"
            )
    return out


def peak_notes(memory: dict[str, Any] | None) -> list[str]:
    """Where a step's measured peak is more than ``PEAK_GAP`` off the prediction."""
    out = []
    for info in (memory or {}).get("models", {}).values():
        off = {
            c: r["peak_vs_predicted"]
            for c, r in info["configs"].items()
            if r.get("peak_vs_predicted") and abs(r["peak_vs_predicted"] - 1) > PEAK_GAP
        }
        if off:
            worst = max(off, key=lambda c: abs(off[c] - 1))
            plain_peak = info["configs"].get("plain", {}).get("step_peak_mb")
            grads = (
                f" Here the parameter gradients alone take {info['grad_mb']:.0f} MB of "
                f"plain's {plain_peak:.0f} MB peak, a floor no activation codec lowers."
                if info.get("grad_mb") and plain_peak
                else ""
            )
            out.append(
                f"{info['description']}: the step peak of {', '.join(off)} is more than "
                f"{100 * PEAK_GAP:.0f}% off what the activation ratio predicts (worst: "
                f"{LABELS.get(worst, worst)}, {off[worst]:.2f}x the prediction). The step peak "
                "also holds the gradients, the codecs' transient buffers during encode and "
                "decode, and what the allocator keeps; a small plain peak magnifies them." + grads
            )
    return out


# ----------------------------------------------------------------------------- bars
def bars(results: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The project's bars, checked against the numbers: (met, not met) lines."""
    met: list[str] = []
    short: list[str] = []
    memory, speed = results.get("memory"), results.get("speed")
    accuracy, tradeoff = results.get("accuracy"), results.get("tradeoff")

    def verdict(ok: bool, text: str) -> None:
        (met if ok else short).append(text)

    resnet = family_model(memory, "resnet") if memory else None
    if memory and resnet:
        r = memory["models"][resnet]["configs"].get(BAR_POLICY)
        if r:
            verdict(
                r["ratio"] >= RATIO_BAR,
                f"activation ratio on the ResNet recipe ({BAR_POLICY}): {r['ratio']:.1f}x "
                f"(bar ≥ {RATIO_BAR:g}x)",
            )
    if accuracy:
        for model, info in accuracy["models"].items():
            plain, r = info["configs"]["plain"], info["configs"].get(BAR_POLICY)
            if r is None:
                continue
            delta = 100 * (r["mean"] - plain["mean"])
            verdict(
                delta >= -ACCURACY_BAR_PP or plain["min"] <= r["mean"] <= plain["max"],
                f"accuracy of {_name(model)} with {BAR_POLICY}: {delta:+.2f} pp "
                f"vs plain (bar: ≥ −{ACCURACY_BAR_PP:g} pp, or within plain's seed range "
                f"[{100 * plain['min']:.2f}, {100 * plain['max']:.2f}]%)",
            )
            if "loss" in r:
                width = plain["loss"]["max"] - plain["loss"]["min"]
                verdict(
                    abs(r["loss_diff"]) <= width,
                    f"validation loss of {_name(model)} with {BAR_POLICY}: "
                    f"{r['loss_diff']:+.4f} ± {r['loss_diff_se']:.4f} vs plain on the same "
                    f"seeds (bar: within plain's seed-to-seed spread {width:.4f})",
                )
    if speed:
        on_cpu = speed["machine"]["device"] == "cpu"
        for model, info in speed["models"].items():
            c = info["configs"]
            if BAR_POLICY not in c:
                continue
            t = c[BAR_POLICY]["vs_plain"]
            if on_cpu:
                verdict(
                    t <= TIME_BAR,
                    f"step time of {_name(model)} with {BAR_POLICY}: "
                    f"{t:.2f}x plain (bar ≤ {TIME_BAR:g}x on CPU)",
                )
            fit = c[BAR_POLICY].get("amortized_vs_plain")
            if on_cpu and fit is not None and speed.get("mode") == "full":
                verdict(
                    fit <= FIT_TIME_BAR,
                    f"step time of {_name(model)} with {BAR_POLICY}, calibration amortized "
                    f"(the speed benchmark: every configuration interleaved, no optimizer "
                    f"step; one calibration step each {speed.get('calibrate_every', 100)} "
                    f"steps, at the median cost of a fit's first three): {fit:.2f}x plain "
                    f"(bar ≤ {FIT_TIME_BAR:g}x at full size on CPU)",
                )
            fixed = c.get(FIXED_BAR_CONFIG, {}).get("vs_plain")
            if on_cpu and fixed is not None:
                verdict(
                    fixed <= FIXED_TIME_BAR,
                    f"step time of {_name(model)} with fixed 2-bit: "
                    f"{fixed:.2f}x plain (bar ≤ {FIXED_TIME_BAR:g}x on CPU)",
                )
            if "checkpoint" in c and not (memory and model in memory["models"]):
                ck_time = c["checkpoint"]["vs_plain"]
                verdict(
                    t < ck_time and (fixed is None or fixed < ck_time),
                    f"{_name(model)}, step time against checkpointing's {ck_time:.2f}x: "
                    f"{BAR_POLICY} {t:.2f}x, fixed 2-bit {_fmt(fixed, '.2f', 'x')} "
                    f"(bar: both faster)",
                )
            if "checkpoint" in c and BAR_POLICY in c and memory and model in memory["models"]:
                mem = memory["models"][model]["configs"]
                ck_time = c["checkpoint"]["vs_plain"]
                ck_mem, own = mem["checkpoint"]["kept_mb"], mem[BAR_POLICY]["kept_mb"]
                verdict(
                    t < ck_time and own <= ck_mem,
                    f"{_name(model)}, {BAR_POLICY} vs checkpointing: "
                    f"{t:.2f}x vs {ck_time:.2f}x step time, {own:.2f} vs {ck_mem:.2f} MB kept "
                    f"(bar: faster at equal or less memory)",
                )
            if "checkpoint" in c and COMBINED in c and memory and model in memory["models"]:
                both = memory["models"][model]["configs"].get(COMBINED)
                if both is not None:
                    verdict(*_combined_line(model, both, c[COMBINED]["vs_plain"], mem, ck_time))
    if tradeoff:
        broken = [r for r in tradeoff["tradeoff"] if r["grad_error_max"] > r["gradient_error"]]
        verdict(
            not broken,
            "acgc's promise, measured error ≤ e on every verified step: "
            + (
                "kept for every e"
                if not broken
                else "broken for e = " + ", ".join(f"{r['gradient_error']:g}" for r in broken)
            ),
        )
    promise = results.get("promise")
    if promise:
        verdict(*promise_bar(promise))
        if "median_global" in promise["summary"]["all"]:
            verdict(*band_bar(promise))
    return met, short


def _combined_line(
    model: str, both: dict[str, Any], t: float, mem: dict[str, Any], ck_time: float
) -> tuple[bool, str]:
    """acgc used together with checkpointing against checkpointing alone: less memory
    within acgc's promise (its measured error ≤ 0.05 = e), and the time it costs."""
    ck_mem, own, err = mem["checkpoint"]["kept_mb"], both["kept_mb"], both.get("grad_error")
    met = own < ck_mem and err is not None and err <= BEST_ERROR
    return met, (
        f"{_name(model)}, {BAR_POLICY} with checkpointing vs checkpointing alone: "
        f"{own:.2f} vs {ck_mem:.2f} MB kept at gradient error {_fmt(err, '.3f')}, "
        f"{t:.2f}x vs {ck_time:.2f}x step time (bar: less memory than checkpointing, within e)"
    )


def notes(memory: dict[str, Any] | None) -> list[str]:
    """Oddities in the numbers worth a line: the meter counting more saved bytes under
    compression than plain training saves (one tensor packed more than once)."""
    out = []
    for model, info in (memory or {}).get("models", {}).items():
        over = {
            config: r
            for config, r in info["configs"].items()
            if r.get("meter_saved_bytes", 0) > 1.01 * r["saved_bytes"]
        }
        if not over:
            continue
        worst = max(over.values(), key=lambda r: r["meter_saved_bytes"])
        factor = worst["meter_saved_bytes"] / worst["saved_bytes"]
        out.append(
            f"{_name(model)} ({', '.join(over)}): under compression the "
            f"meter counts up to {worst['meter_saved_bytes'] / MB:.2f} MB saved against "
            f"{worst['saved_mb']:.2f} MB in plain training (some tensor is packed more than "
            f"once), so the logged `acgc/ratio` overstates the ratio against plain training "
            f"by up to {factor:.2f}x; the table divides by the plain bytes"
        )
    return out
