"""benchmarks/cpu_backends.py: every implementation of the 2-bit encode it times writes
the reference's codes, and README's table is made from its line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_backends
from benchmarks._codec_tables import backends_table
from benchmarks.report import RESULTS, render
from benchmarks.run_all import store
from lightning_acgc.kernels.quant.reference import _lowbias32, hash_key, quant_encode_ref


def _groups(seed: int, groups: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, cpu_backends.GROUP, generator=gen)
    x[0] = 0.0  # a constant group: step 0, every code 0
    x[1] *= 1e-30  # tiny values (an inverse near float32's top)
    x[2] = x[2].relu() + 1.0  # positive, away from 0
    return x


@pytest.mark.parametrize("seed", [0, 3, 2**40 + 5])
def test_torch_ops_write_the_reference_codes(seed: int) -> None:
    xg = _groups(seed % 97, 37)
    kh = _lowbias32(hash_key(seed))
    expected = quant_encode_ref(xg.view(-1), 2, cpu_backends.GROUP, seed)["codes"]
    assert torch.equal(cpu_backends.quant2_torch(xg, kh), expected)


def test_numba_writes_the_reference_codes_where_installed() -> None:
    run = cpu_backends.numba_encoder()
    if run is None:
        pytest.skip("numba is not installed (no dependency of the project)")
    xg = _groups(1, 19)
    expected = quant_encode_ref(xg.view(-1), 2, cpu_backends.GROUP, 9)["codes"]
    assert torch.equal(run(xg, _lowbias32(hash_key(9))), expected)


@pytest.mark.slow
def test_measure_checks_every_implementation_and_times_it(capsys) -> None:
    """Inductor compiles the function on its first call (tens of seconds on 2 cores)."""
    result = cpu_backends.main(["--quick", "--size-mb", "0.25", "--rounds", "2"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["benchmark"] == "cpu_backends" and printed["mode"] == "quick"
    rows = result["implementations"]
    assert {"reference", "torch_ops", "inductor", "c"} <= set(rows)
    assert rows["reference"]["matches_reference"] and rows["torch_ops"]["matches_reference"]
    assert rows["c"]["matches_reference"]
    assert all(r["x_clone"] > 0 and r["gbps"] > 0 for r in rows.values())


def _line() -> dict:
    row = {"matches_reference": True, "x_clone": 2.5, "x_clone_min": 2.0, "gbps": 30.0}
    return {
        "benchmark": "cpu_backends",
        "mode": "full",
        "machine": {},
        "job": "quant encode, 2 bits",
        "tensor_mb": 4.0,
        "threads": 2,
        "rounds": 3,
        "clone_gbps": 150.0,
        "numba": "not installed",
        "implementations": {"c": row, "inductor": row | {"matches_reference": False}},
    }


def test_table_names_each_implementation_and_its_match() -> None:
    table = backends_table(_line())
    assert "numba: not installed" in table[0]
    assert "| the C/OpenMP library (what the codecs use) | yes | 2.50 (2.00) | 30.00 |" in table
    compiled = [r for r in table if r.startswith("| that function through `torch.compile`")]
    assert len(compiled) == 1 and "| no |" in compiled[0]
    assert backends_table(None) == ["(cpu_backends: not run)"]


def test_report_shows_the_backends_table(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    (results / "cpu_backends.jsonl").unlink(missing_ok=True)
    assert "(cpu_backends: not run)" in render(results)
    store(_line(), results)
    assert "| the C/OpenMP library (what the codecs use) | yes |" in render(results)
