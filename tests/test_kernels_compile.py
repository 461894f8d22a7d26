"""Every Triton kernel compiles for an H100 (sm_90) without a GPU (Triton ships ptxas):
catches what the interpreter cannot see. One parametrized test over the kernel families."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_SCRIPTS = {
    "quant": """
enc = dict(x_ptr="*bf16", noise_ptr="*fp32", codes_ptr="*u8", lo_ptr="*fp32",
           scale_ptr="*fp32", status_ptr="*i32", numel="i32", n_groups="i32", seed="i64")
dec = dict(codes_ptr="*u8", lo_ptr="*fp32", scale_ptr="*fp32", f64_ptr="*i32",
           out_ptr="*fp64", numel="i32", n_groups="i32")
for bits, noise in ((1, False), (2, True), (8, False)):
    compile_for_cuda(m._quant_encode_kernel, enc, dict(
        GROUP=256, GROUP_P2=256, BITS=bits, GPP=8, USE_NOISE=noise, IDX64=False,
        INTERPRET=False))
for kind, ptr in ((2, "*i16"), (3, "*fp64")):
    compile_for_cuda(m._quant_decode_kernel, {**dec, "out_ptr": ptr}, dict(
        GROUP=64, GROUP_P2=64, BITS=4, GPP=32, IDX64=True, OUT_KIND=kind))
compile_for_cuda(m._quant_wide_kernel, dict(lo_ptr="*fp32", scale_ptr="*fp32",
                 flag_ptr="*i32", n_groups="i32"), dict(LEVELS=15, BLOCK=2048, INTERPRET=False))
""",
    "mask": """
compile_for_cuda(m._mask_pack_kernel, dict(mask_ptr="*u8", packed_ptr="*u8", numel="i32",
                 n_bytes="i32"), dict(BYTES=256, IDX64=False))
compile_for_cuda(m._mask_unpack_kernel, dict(packed_ptr="*u8", out_ptr="*u8", numel="i64"),
                 dict(BYTES=256, IDX64=True))
""",
    "bounded": """
c = dict(GROUP=256, GROUP_P2=256, GPP=8)
compile_for_cuda(m._stats_kernel, dict(x_ptr="*fp16", lo_ptr="*fp32", hi_ptr="*fp32",
                 min_pos_ptr="*fp32", has_zero_ptr="*u8", n_bad_ptr="*i32", numel="i32",
                 n_groups="i32"), dict(c, IDX64=False))
enc = dict(x_ptr="*bf16", rows_ptr="*i64", lo_ptr="*fp32", step_ptr="*fp32",
           fill_ptr="*fp32", width_ptr="*u8", off_ptr="*i64", raw_rank_ptr="*i64",
           codes_ptr="*u8", raw_ptr="*i16", n_viol_ptr="*i32", flags_ptr="*u8",
           numel="i32", n_rows="i32", eb32="fp32", fmax="fp32")
for flags in (False, True):
    compile_for_cuda(m._encode_kernel, enc, dict(c, OUT_KIND=2, FLAGS=flags,
                     INTERPRET=False, IDX64=False))
compile_for_cuda(m._decode_kernel, dict(codes_ptr="*u8", lo_ptr="*fp32", step_ptr="*fp32",
                 width_ptr="*u8", off_ptr="*i64", raw_rank_ptr="*i64", raw_ptr="*fp16",
                 out_ptr="*fp16", numel="i32", n_groups="i32", fmax="fp32"),
                 dict(c, OUT_KIND=1, INTERPRET=False, IDX64=False))
""",
    "division": """
compile_for_cuda(m._pool_kernel, dict(src_ptr="*bf16", dst_ptr="*fp32", n_rows="i32",
                 L="i32", Lo="i32", inner="i32", blk="i32"), dict(BR=2, BI=1024, IDX64=False))
tile = dict(a_ptr="*fp32", low_ptr="*bf16", out_ptr="*i16", zbits_ptr="*u8",
            min_pos_ptr="*fp32", n_rows="i32", W="i32", A="i32", B="i32", A2="i32",
            B2="i32", W2="i32", blk="i32", fmax="fp32")
for decode in (False, True):
    compile_for_cuda(m._tile_kernel, {**tile, "out_ptr": "*i16" if decode else "*fp32"},
                     dict(BR=32, BC=64, LAST_POOLED=True, DECODE=decode, HAS_ZERO=decode,
                          HAS_MIN=decode, OUT_KIND=2, IDX64=False))
""",
    "channels": """
for ptr, bf16 in (("*fp32", False), ("*i16", True)):
    compile_for_cuda(m._row_stats_kernel, dict(x_ptr=ptr, lo_ptr="*fp32", hi_ptr="*fp32",
                     bad_ptr="*u8", plane="i32"), dict(BLOCK=1024, IDX64=False, BF16=bf16))
    compile_for_cuda(m._normalize_kernel, dict(x_ptr=ptr, m_ptr="*fp32", inv_ptr="*fp32",
                     y_ptr="*fp32", numel="i64", plane="i32", c="i32"),
                     dict(BLOCK=2048, IDX64=True, BF16=bf16, INTERPRET=False))
compile_for_cuda(m._channel_params_kernel, dict(lo_ptr="*fp32", hi_ptr="*fp32",
                 bad_ptr="*u8", m_ptr="*fp32", s_ptr="*fp32", inv_ptr="*fp32", n="i32",
                 c="i32", tiny="fp32"), dict(BLOCK_C=128, INTERPRET=False))
""",
}


@pytest.mark.parametrize("family", sorted(_SCRIPTS))
def test_kernels_compile_for_cuda(family: str) -> None:
    """Compile the family's kernels for sm_90 in a process without TRITON_INTERPRET."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    header = (
        "from lightning_acgc.kernels.common.triton_utils import compile_for_cuda\n"
        f"from lightning_acgc.kernels.{family} import triton as m\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", header + _SCRIPTS[family]], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
