#!/usr/bin/env bash
# The island's GPU checks, in one pass on a CUDA machine (CI has no GPU: these tests skip there).
#
#   bash bench/gpu_check.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else /tmp/gpu-check
#
# 1. tests/island/test_island_cuda.py (capabilities, bf16 autocast, CUDA vs CPU steps) and the CLI's refusal of
#    more CUDA processes than GPUs;
# 2. the end-to-end test (a real coordinator, two islands with --device cuda, every outer step recomputed from
#    the stored contributions), via DIPACO_TEST_ISLAND_DEVICE=cuda;
# 3. bench/bench_island.py --device cuda for the small and paper-150m flavours: the island's loop against a
#    bare loop, and a round's wall-clock split (fetch / train / upload) on loopback.
# Each part has its own time limit and log (OUT_DIR/NAME.log); OUT_DIR/summary lists each part's exit code.
# Python packages the machine lacks can travel as py3.12 wheels in .whl/ (docs/LOG.md, 2026-12-04 session 5).
set -u
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
if [ -d .whl ] && [ -z "${GPU_CHECK_NO_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
device=${GPU_CHECK_DEVICE:-cuda}
py=${PYTHON:-python3}

part() {  # part NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${limit}s-limit took $((SECONDS - t0))s" | tee -a "$out/summary"
    tail -n 25 "$out/$name.log"
}

nvidia-smi -L 2>&1 | tee "$out/summary"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))" \
    | tee -a "$out/summary"
part cuda-tests 90 $py -m pytest -q -s -p no:cacheprovider tests/island/test_island_cuda.py \
    "tests/island/test_island_cli.py::test_more_cuda_processes_than_gpus_is_a_usage_error_before_any_follower_starts"
part end-to-end 150 env DIPACO_TEST_ISLAND_DEVICE="$device" $py -m pytest -q -p no:cacheprovider \
    tests/integration/test_end_to_end.py -k "sqlite"
part bench-small 100 $py bench/bench_island.py --device "$device" --flavour small --steps 200 --reps 5 --rounds 4
part bench-150m 170 $py bench/bench_island.py --device "$device" --flavour paper-150m --steps 40 --reps 3 --rounds 3
