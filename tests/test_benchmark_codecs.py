"""benchmarks/codecs.py prints what README's codec table and bar are made from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks import codecs
from benchmarks._codec_tables import CLONE_BAR, codec_bars, codecs_table
from benchmarks.report import RESULTS, render
from benchmarks.run_all import store


def test_codecs_line_has_ratio_and_times_per_size(capsys) -> None:
    args = ["--quick", "--device", "cpu", "--sizes-mb", "1", "--rounds", "2"]
    result = codecs.main([*args, "--only", "quant2", "mask"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["benchmark"] == "codecs" and printed["mode"] == "quick"
    rows = result["sizes"]["1MB"]
    assert set(rows) == {"quant2", "mask"}
    assert 13 < rows["quant2"]["ratio"] < 16  # 2 bits + 64 bits of metadata per 256 values
    assert 7.9 < rows["mask"]["ratio"] <= 8  # a bool tensor as one bit per value
    for r in rows.values():
        assert r["encode_x_clone"] > 0 and r["decode_gbps"] > 0


def _line(encode: float, decode: float) -> dict:
    r = {"ratio": 14.0, "encode_x_clone": encode, "decode_x_clone": decode}
    r |= {"encode_x_clone_min": encode, "decode_x_clone_min": decode}
    return r | {"encode_gbps": 1.0, "decode_gbps": 1.0, "clone_gbps": 10.0}


def test_codec_bar_names_each_slow_codec() -> None:
    line = {
        "tensor": "t",
        "threads": 2,
        "rounds": 3,
        "sizes": {"4MB": {"quant2": _line(2.0, 9.0), "mask": _line(1.0, 1.0)}},
    }
    met, short = codec_bars(line)
    assert not met and len(short) == 1 and "quant2 decode 9.0x" in short[0]
    assert "mask" not in short[0]
    line["sizes"]["4MB"]["quant2"] = _line(CLONE_BAR, 1.0)
    met, short = codec_bars(line)
    assert not short and len(met) == 1 and "every encode and decode" in met[0]
    assert len(codecs_table(line)) == 4 + 2


def test_report_shows_the_codec_table(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    (results / "codecs.jsonl").unlink(missing_ok=True)
    assert "(codecs: not run)" in render(results)
    line = {"benchmark": "codecs", "mode": "full", "machine": {}, "tensor": "t", "threads": 2}
    store(line | {"rounds": 3, "sizes": {"64MB": {"quant2": _line(3.0, 2.5)}}}, results)
    text = render(results)
    assert "| 64MB | quant2 | 14.00x | 3.00 (3.00) | 2.50 (2.50) |" in text
    assert "met: codec speed at 64MB" in text
