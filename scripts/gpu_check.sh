#!/usr/bin/env bash
# The checks that need a CUDA device, in one run: the tests marked gpu with the Triton
# kernels compiled for the card (TRITON_INTERPRET=0), then the kernel, codec, speed and
# memory benchmarks with --device cuda, a profile of the hooks and the quant kernels'
# device and host time. Each phase has its own time limit and its own output file, so a
# slow or failing phase leaves the others' results.
#   bash scripts/gpu_check.sh OUTDIR
# Outputs in OUTDIR: tests.log (environment and pytest), kernels.jsonl, codecs.jsonl,
# speed.jsonl, memory.jsonl (one JSON line per benchmark run), profile.jsonl (host syncs,
# host-time ops and Python of a ResNet-50 step, scripts/gpu_profile.py), kernel_ab.jsonl
# (the quant kernels' device time against a copy's and host time a call,
# scripts/gpu_kernel_ab.py; BASELINE_JIT=path/to/old/triton_jit.py adds an older version's
# kernels side by side), bench.err (their progress bars and errors).
# Runs with the Python in $PYTHON (default: python3), which must hold torch with CUDA,
# triton, lightning, transformers and torch_geometric; hydra-core and omegaconf may come
# through PYTHONPATH.
set -u
out="${1:?usage: scripts/gpu_check.sh OUTDIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

phase() {  # phase SECONDS NAME COMMAND...: run with a limit, say how it ended
    local limit=$1 name=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    echo "== $name: exit $? after $((SECONDS - start)) s" >&2
}

{
    nvidia-smi -L
    "$py" -c "import torch, triton, lightning; print('torch', torch.__version__, 'triton', \
triton.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name())"
    extra=()  # pytest-xdist and pytest-timeout where installed
    "$py" -c "import xdist" 2>/dev/null && extra+=(-n 8)
    "$py" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 150)
    phase 200 tests "$py" -m pytest tests -m gpu -q -p no:cacheprovider -o addopts="-ra" \
        "${extra[@]}"
} >"$out/tests.log" 2>&1

exec 2>>"$out/bench.err"
{
    phase 25 kernels-fp32 "$py" -m benchmarks.kernels --device cuda --size $((1 << 24)) --relu
    phase 25 kernels-bf16 "$py" -m benchmarks.kernels --device cuda --size $((1 << 24)) \
        --dtype bfloat16 --bits 4
} >"$out/kernels.jsonl"
phase 50 codecs "$py" -m benchmarks.codecs --device cuda >"$out/codecs.jsonl"
phase 100 speed "$py" -m benchmarks.speed --device cuda --batch-size 64 >"$out/speed.jsonl"
phase 100 memory "$py" -m benchmarks.memory --device cuda --batch-size 64 >"$out/memory.jsonl"
phase 60 profile "$py" scripts/gpu_profile.py --configs plain quant2 acgc >"$out/profile.jsonl"
phase 40 kernel-ab "$py" scripts/gpu_kernel_ab.py ${BASELINE_JIT:+--baseline "$BASELINE_JIT"} \
    >"$out/kernel_ab.jsonl"
grep "^== " "$out/tests.log" "$out/bench.err" >&1
