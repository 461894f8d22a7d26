"""README's codec speed table and the codec bar (``benchmarks/codecs.py``'s line)."""

from __future__ import annotations

from typing import Any

__all__ = ["CLONE_BAR", "backends_table", "codec_bars", "codecs_table"]

CLONE_BAR = 4.0  # encode and decode each at most this multiple of x.clone() (issue 14)


def codecs_table(codecs: dict[str, Any] | None) -> list[str]:
    """One row per codec setting and tensor size: ratio, encode and decode as multiples
    of ``x.clone()`` (median, and min in brackets) and their GB/s beside the clone's."""
    if codecs is None:
        return ["(codecs: not run)"]
    out = [
        f"{codecs['tensor']}, {codecs['threads']} thread(s), {codecs['rounds']} interleaved "
        "rounds; GB/s counts bytes read plus written; × clone against the clone times of "
        "every setting on the same input, pooled. Where the clone runs at a few GB/s the "
        "fresh pages of its output are faulted in (large allocations on CPU), a cost every "
        "decode pays too: there the ratios flatter the codecs, compare the GB/s.",
        "",
        "| size | codec | ratio | encode × clone | decode × clone | encode GB/s | "
        "decode GB/s | clone GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size, settings in codecs["sizes"].items():
        for name, r in settings.items():
            out.append(
                f"| {size} | {name} | {r['ratio']:.2f}x | {r['encode_x_clone']:.2f} "
                f"({r['encode_x_clone_min']:.2f}) | {r['decode_x_clone']:.2f} "
                f"({r['decode_x_clone_min']:.2f}) | {r['encode_gbps']:.2f} | "
                f"{r['decode_gbps']:.2f} | {r['clone_gbps']:.2f} |"
            )
    return out


def codec_bars(codecs: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(met, not met): per tensor size, every codec's median encode and decode within
    ``CLONE_BAR`` times the clone of the same tensor."""
    met: list[str] = []
    short: list[str] = []
    for size, settings in (codecs or {}).get("sizes", {}).items():
        ratios = {
            f"{name} {k}": r[f"{k}_x_clone"]
            for name, r in settings.items()
            for k in ("encode", "decode")
        }
        slow = {k: v for k, v in ratios.items() if v > CLONE_BAR}
        text = f"codec speed at {size} ({codecs['threads']} thread(s)): "
        if slow:
            worst = sorted(slow.items(), key=lambda kv: -kv[1])
            listed = ", ".join(f"{k} {v:.1f}x" for k, v in worst)
            short.append(text + f"{listed} clone (bar ≤ {CLONE_BAR:g}x each)")
        else:
            name, value = max(ratios.items(), key=lambda kv: kv[1])
            met.append(
                text + f"every encode and decode ≤ {CLONE_BAR:g}x clone (the slowest: {name} "
                f"{value:.2f}x, in one run: on this shared machine the 4 MB medians moved by up "
                "to a third between runs)"
            )
    return met, short


BACKENDS = {  # benchmarks/cpu_backends.py's implementations, as README names them
    "reference": "pure-torch reference (the specification), eager",
    "torch_ops": "the same arithmetic as one function of torch ops, eager",
    "inductor": "that function through `torch.compile` (Inductor's CPU code)",
    "numba": "a `numba.njit(parallel=True)` loop",
    "c": "the C/OpenMP library (what the codecs use)",
}


def backends_table(line: dict[str, Any] | None) -> list[str]:
    """One row per implementation of the 2-bit encode: whether its codes are the
    reference's, its time as a multiple of ``x.clone()`` (median, min) and its GB/s."""
    if line is None:
        return ["(cpu_backends: not run)"]
    out = [
        f"{line['job']}; {line['tensor_mb']:g} MB, {line['threads']} thread(s), "
        f"{line['rounds']} interleaved rounds, clone {line['clone_gbps']:.1f} GB/s; numba: "
        f"{line['numba']}.",
        "",
        "| implementation | codes = reference's | × clone | GB/s |",
        "| --- | --- | --- | --- |",
    ]
    for name, r in line["implementations"].items():
        same = "yes" if r["matches_reference"] else "no"
        out.append(
            f"| {BACKENDS.get(name, name)} | {same} | {r['x_clone']:.2f} "
            f"({r['x_clone_min']:.2f}) | {r['gbps']:.2f} |"
        )
    return out
