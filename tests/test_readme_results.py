"""README's results section is generated: it must equal what ``benchmarks/report.py``
renders from the committed ``benchmarks/results/*.jsonl``, and every plot it links must
be in ``docs/``. Nothing is written here: the report is rendered to a string."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from benchmarks.report import (
    GLANCE,
    README_PATH,
    RESULTS,
    load_all,
    main_mode,
    readme_section,
    render,
    render_glance,
)
from benchmarks.run_all import store

ROOT = RESULTS.parent.parent


def test_readme_results_section_is_what_the_report_makes() -> None:
    expected = render(RESULTS)
    got = readme_section(README_PATH)
    assert got == expected, (
        "README.md's results section differs from the committed results: run "
        "`python -m benchmarks.report` and commit README.md and docs/"
    )


def test_readme_glance_is_what_the_report_makes() -> None:
    got = readme_section(README_PATH, GLANCE)
    assert got == render_glance(RESULTS), (
        "README.md's At a glance section differs from the committed results: run "
        "`python -m benchmarks.report` and commit README.md"
    )
    assert "| ResNet-50" in got and "| bert:" in got  # the full-size step and the sweep


def test_a_changed_result_changes_the_glance(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    by_mode = load_all(results)
    memory = by_mode[main_mode(by_mode)]["memory"]
    next(iter(memory["models"].values()))["configs"]["acgc"]["kept_mb"] += 1.0
    store(memory, results)
    assert render_glance(results) != render_glance(RESULTS)


def test_every_linked_plot_exists() -> None:
    links = re.findall(r"\]\((docs/[\w.]+\.png)\)", readme_section(README_PATH))
    assert links, "the results section links no plot"
    for link in links:
        assert (ROOT / link).is_file(), link


def test_results_carry_mode_machine_and_commit() -> None:
    everything = load_all(RESULTS)
    assert "memory" in everything["quick"] or "memory" in everything["full"]
    for mode, results in everything.items():
        for name, result in results.items():
            assert result["mode"] == mode, name
            assert {"device", "cpu", "date", "torch"} <= set(result["machine"]), name
    for name in ("memory", "speed"):
        for result in (everything["quick"].get(name), everything["full"].get(name)):
            if result is not None:
                assert result.get("commit"), name


def test_a_changed_result_changes_the_section(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    by_mode = load_all(results)
    shown = main_mode(by_mode)  # the mode whose memory table the section shows
    memory = by_mode[shown]["memory"]
    model = next(iter(memory["models"].values()))
    model["configs"]["plain"]["saved_mb"] += 1.0
    store(memory, results)
    assert render(results) != render(RESULTS)


def test_full_results_are_shown_and_labelled_beside_quick_ones(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    quick = load_all(results)["quick"]
    for name in ("memory", "speed"):
        full = json.loads(json.dumps(quick[name]))
        full["mode"] = "full"
        store(full, results)
    text = render(results)
    assert "*full mode*" in text
    rows = [line for line in text.splitlines() if line.startswith(("| full |", "| quick |"))]
    assert {row.split("|")[1].strip() for row in rows} == {"full", "quick"}
    assert len(load_all(results)["quick"]) == len(quick)  # storing full kept the quick lines


@pytest.mark.parametrize("mode", ["quick", "full"])
def test_store_replaces_only_the_line_of_its_mode(tmp_path: Path, mode: str) -> None:
    store({"benchmark": "speed", "mode": "quick", "n": 1}, tmp_path)
    store({"benchmark": "speed", "mode": "full", "n": 2}, tmp_path)
    store({"benchmark": "speed", "mode": mode, "n": 3}, tmp_path)
    lines = [json.loads(s) for s in (tmp_path / "speed.jsonl").read_text().splitlines()]
    assert sorted((r["mode"], r["n"]) for r in lines) == sorted(
        [(mode, 3), ("full" if mode == "quick" else "quick", 2 if mode == "quick" else 1)]
    )


def test_the_sweep_table_is_made_from_its_run_lines(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    sweep = results / "sweep.jsonl"
    assert "Paired-seed accuracy sweep" in render(results)
    runs = [json.loads(line) for line in sweep.read_text().splitlines() if line.strip()]
    # the last run of a (recipe, configuration, seed) is the one the table shows
    last = max(i for i, r in enumerate(runs) if r.get("kind") == "run")
    runs[last]["val_loss"] += 1.0
    sweep.write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert render(results) != render(RESULTS)
    sweep.unlink()
    assert "Paired-seed accuracy sweep" not in render(results)


def test_peak_note_names_the_gradients_floor() -> None:
    from benchmarks._tables import peak_notes

    configs = {
        "plain": {"step_peak_mb": 477.0, "peak_vs_predicted": 1.0},
        "checkpoint": {"step_peak_mb": 448.0, "peak_vs_predicted": 7.07},
    }
    memory = {"models": {"bert": {"description": "BERT", "configs": configs}}}
    (note,) = peak_notes(memory)
    assert "checkpoint" in note and "gradients alone" not in note
    memory["models"]["bert"]["grad_mb"] = 417.6
    (note,) = peak_notes(memory)
    assert "the parameter gradients alone take 418 MB of plain's 477 MB peak" in note


def test_acgc_at_fixed_settings_errors_is_a_bar(tmp_path: Path) -> None:
    """The acgc_vs_fixed line fills its table and one bar per mode: not met while a
    setting's share of the ratio is under 95% or acgc measured over the error."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    line = json.loads(json.dumps(load_all(results)["quick"]["acgc_vs_fixed"]))
    for info in line["models"].values():
        for key in ("quant2", "quant4", "gact"):
            info["results"][key]["acgc_at_its_error"].update(ratio_share=0.97, within=True)
    store(line, results)
    assert "- met: acgc at each fixed setting's own error (quick mode)" in render(results)
    first = next(iter(line["models"].values()))["results"]["quant4"]["acgc_at_its_error"]
    first["within"] = False
    store(line, results)
    text = render(results)
    assert "- not met: acgc at each fixed setting's own error (quick mode)" in text
    assert "over its error" in text


def test_acgc_held_to_the_global_promise_alone_is_shown_beside_it(tmp_path: Path) -> None:
    """acgc's global-promise-only measurement fills its column and the bar's range; the
    bar itself stays on acgc with its per-layer promise."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    line = json.loads(json.dumps(load_all(results)["quick"]["acgc_vs_fixed"]))
    for info in line["models"].values():
        for key, share in (("quant2", 1.31), ("quant4", 0.88), ("gact", 0.97)):
            base = info["results"][key]["baseline"]
            info["results"][key]["acgc_global_only"] = {
                "grad_error": base["grad_error"] / 2,
                "ratio": base["ratio"] * share,
                "ratio_share": share,
                "within": key != "gact",
            }
        acgc = info["results"]["gact"]["acgc_at_its_error"]  # below the bar's 95%
        acgc["ratio_share"], acgc["ratio"] = 0.9, info["results"]["gact"]["baseline"]["ratio"] * 0.9
    store(line, results)
    text = render(results)
    assert "| global promise only: measured, ratio (share), within |" in text
    assert "(131%), yes |" in text and "(97%), no |" in text
    assert "held to the global promise alone, acgc keeps 88-131% of the settings' ratios" in text
    assert "- not met: acgc at each fixed setting's own error (quick mode)" in text


def test_gpu_lines_are_stored_beside_cpu_lines_and_shown_apart(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    cpu_memory = load_all(results)["full"]["memory"]
    gpu = json.loads(json.dumps(cpu_memory))
    gpu["machine"] = {**gpu["machine"], "device": "cuda", "gpu": "Test GPU"}
    gpu["note"] = "a test line"
    store(gpu, results)
    lines = [json.loads(s) for s in (results / "memory.jsonl").read_text().splitlines()]
    assert sum(r["mode"] == "full" for r in lines) == 2  # the CPU full line stays
    assert load_all(results)["full"]["memory"]["machine"]["device"] == "cpu"
    text = render(results)
    gpu_part = text[text.index("### On a GPU") :]
    assert "Test GPU" in gpu_part and "a test line" in gpu_part
    store({**gpu, "note": "replaced"}, results)  # the same mode and device: replaced
    assert "a test line" not in render(results)


def test_kernels_table_names_copy_multiples() -> None:
    from benchmarks._gpu_tables import kernels_table

    run = {
        "codec": "quant",
        "copy_gbps": 2000.0,
        "copy_ms": 0.1,
        "triton": {"encode_gbps": 200.0, "decode_gbps": 100.0, "encode_ms": 0.5, "decode_ms": 1},
        "torch": {"encode_gbps": 20.0, "decode_gbps": 90.0},
    }
    settings = {"size": 1024, "dtype": "float32", "bits": 2, "relu": True, "repeat": 3}
    rows = kernels_table({"settings": settings, "runs": [run]})
    assert rows[-1] == "| quant | 2000 | 200 (5.0) | 100 (10.0) | 20 | 90 |"


def _paragraph(title: str) -> str:
    text = README_PATH.read_text()
    start = text.index(f"**{title}**")
    return " ".join(text[start : text.index("\n\n", start)].split())


def test_how_much_of_e_quotes_the_committed_held_out_checks() -> None:
    """The prose of "How much of e a calibration uses" quotes the margin fits' checks of the
    step after each calibration and the removed rehearsals' result line as committed."""
    prose = _paragraph("How much of e a calibration uses.")
    margin = json.loads((RESULTS / "margin.jsonl").read_text().splitlines()[-1])
    held = {t: f["all"] for t, f in margin["fits"].items()}
    default = held[str(margin["default_target"])]
    assert f"hold on {default['held_out_kept']} of {default['held_out_checks']} checks" in prose
    for target, label in (("0.45", "0.45"), ("0.6", "0.6"), ("1.0", "`target=1`")):
        assert f"{held[target]['held_out_kept']} at {label}" in prose, target
    line = (RESULTS / "experiments" / "promise_rehearsals.jsonl").read_text().splitlines()[-1]
    s = json.loads(line)["summary"]["all"]
    assert f"kept both promises on {s['kept']} of {s['calibrations']}" in prose
    assert f"a median of {s['median_global']:.2f}e" in prose
    assert f"on the step after on {s['held_out_kept']} of {s['held_out_checks']}" in prose


def test_how_much_of_e_quotes_the_committed_margin_fits() -> None:
    """The same prose's medians, kept calibrations and ratios per target are the margin
    fits' as committed."""
    prose = _paragraph("How much of e a calibration uses.")
    margin = json.loads((RESULTS / "margin.jsonl").read_text().splitlines()[-1])
    fits = margin["fits"]
    default = fits[str(margin["default_target"])]["all"]
    assert f"global error of {default['median_global']:.2f}e" in prose
    assert f"worst layer at {default['median_layer']:.2f} of that layer's bound" in prose
    for target in ("0.45", "0.6"):
        f = fits[target]["all"]
        assert f"{f['median_global']:.2f}e / {f['median_layer']:.2f}" in prose, target
        assert f"{f['layer_kept']} of {f['calibrations']}" in prose, target
    loose = fits["1.0"]
    assert f"at {loose['all']['median_global']:.2f}e with its worst layer at" in prose
    assert f"holds on only {loose['all']['layer_kept']} of" in prose
    for recipe in ("charlm", "resnet", "bert", "gnn"):
        assert f"{recipe} {loose[recipe]['ratio']:.1f}x" in prose, recipe
        ratio = fits[str(margin["default_target"])][recipe]["ratio"]
        assert f"{ratio:.1f}x" in prose.split("against the default's")[1][:60], recipe


def test_causal_lm_promise_prose_quotes_the_committed_experiments() -> None:
    """The causal-LM paragraph's promise figures (before, after the attention output was
    remade, with every class probed, with the budget held) are the committed lines of
    ``experiments/promise_lm.jsonl``."""
    text = " ".join(README_PATH.read_text().split())
    lines = (RESULTS / "experiments" / "promise_lm.jsonl").read_text().splitlines()
    before, after, probed, held = (json.loads(line) for line in lines)

    def kept(line: dict) -> tuple[int, int]:
        return line["summary"]["llama"]["kept"], line["summary"]["gpt2"]["kept"]

    def ratios(line: dict) -> tuple[str, str]:
        return tuple(  # type: ignore[return-value]
            f"{statistics.mean(r['ratio'] for r in line['runs'] if r['recipe'] == m):.1f}x"
            for m in ("llama", "gpt2")
        )

    assert "held on {} of 156 Llama calibrations and {} of 156 GPT-2".format(*kept(after)) in text
    assert "against {} and {} with the output stored".format(*kept(before)) in text
    assert "at {} and {} against {} and {}".format(*ratios(after), *ratios(before)) in text
    assert f"kept as many, {probed['summary']['all']['kept']} of 312, at" in text
    assert "{} and {} at {} and {}".format(*kept(held), *ratios(held)) in text


def test_attribution_prose_quotes_the_committed_experiments() -> None:
    """The causal-LM paragraph's attribution of the Llama's step-5 breaks (the final
    norm's input, its widths and readings, with and without the scaled factor) is the
    committed lines of ``experiments/attribution.jsonl``."""
    text = " ".join(README_PATH.read_text().split())
    lines = (RESULTS / "experiments" / "attribution.jsonl").read_text().splitlines()
    seed1, seed0, scaled1, scaled0 = (json.loads(line) for line in lines)

    def final_norm(line: dict) -> dict:
        (entry,) = (c for c in line["classes"] if c["class"].endswith("model.norm:0"))
        return entry

    def bits(line: dict) -> str:
        (setting,) = final_norm(line)["settings"].values()
        return f"{float(setting.removeprefix('bits=')):.2f}"

    def both(fmt: str, a: float, b: float, unit: str = "") -> str:
        return f"{a:{fmt}}{unit} and {b:{fmt}}{unit}"

    assert f"at {bits(seed1)} and {bits(seed0)} bits) alone" in text
    one, zero = final_norm(seed1), final_norm(seed0)
    assert both(".2f", one["worst_layer"], zero["worst_layer"], "x") + " its bound" in text
    assert "global error at " + both(".2f", one["global"], zero["global"], "e") in text
    cal1, cal0 = seed1["calibration"], seed0["calibration"]
    assert "measured " + both(".2f", cal1["worst_layer"], cal0["worst_layer"], "x") in text
    assert both(".2f", cal1["global"], cal0["global"], "e") + ": seed 1's" in text
    others = max(c["worst_layer"] for line in (seed1, seed0) for c in line["classes"]
                 if c is not final_norm(line))  # fmt: skip
    assert f"each other class at most {others:.2f} of any bound" in text
    assert f"only to {bits(scaled1)} and {bits(scaled0)} bits" in text
    s1, s0 = final_norm(scaled1), final_norm(scaled0)
    assert f"({both('.2f', s1['worst_layer'], s0['worst_layer'], 'x')})" in text


def test_first_speed_run_prose_quotes_the_committed_experiment() -> None:
    """The "Time on a CPU" paragraph's figures of the first speed run at 73a8a47 (the
    run before the one under Results, same code and host) are the committed line of
    ``experiments/speed_73a8a47_first_run.jsonl``."""
    text = " ".join(README_PATH.read_text().split())
    (line,) = (RESULTS / "experiments" / "speed_73a8a47_first_run.jsonl").read_text().splitlines()
    models = json.loads(line)["models"]

    def ratio(model: str, config: str = "acgc", key: str = "vs_plain") -> str:
        return f"{models[model]['configs'][config][key]:.2f}x"

    resnet, bert = ratio("resnet50_imagenet"), ratio("bert_base")
    amortized = [ratio(m, key="amortized_vs_plain") for m in ("resnet50_imagenet", "bert_base")]
    assert f"measured {resnet} and {bert} (amortized {amortized[0]} and {amortized[1]})" in text
    assert f"{ratio('gcn_256')} on the GCN, {ratio('resnet18')} on ResNet-18" in text
    quant = [ratio(m, "quant2") for m in ("resnet50_imagenet", "bert_base")]
    assert f"with fixed 2-bit at {quant[0]} and {quant[1]} against" in text
