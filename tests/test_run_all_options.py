"""``benchmarks.run_all`` hands each benchmark the options it takes and no other."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.run_all import BENCHMARKS, ROUNDS, extra_options


def test_rounds_go_to_the_benchmarks_that_repeat_rounds() -> None:
    assert extra_options("speed", None, 9) == ["--rounds", "9"]
    assert extra_options("memory", 8, 9) == ["--batch-size", "8"]
    assert extra_options("speed", None, None) == []


@pytest.mark.parametrize("name", ROUNDS)
def test_each_rounds_benchmark_accepts_rounds(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own parser takes ``--rounds`` (parsing stops before any measurement)."""
    assert name in BENCHMARKS
    module = __import__(f"benchmarks.{name}", fromlist=["main"])
    seen: dict[str, int] = {}

    def stop(self: argparse.ArgumentParser, args: list[str] | None = None, namespace=None):  # type: ignore[no-untyped-def]
        parsed = original(self, args, namespace)
        seen["rounds"] = parsed.rounds
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr("sys.argv", [name, "--rounds", "3"])
    with pytest.raises(SystemExit):
        module.main()
    assert seen == {"rounds": 3}
