#!/usr/bin/env bash
# On a machine with one CUDA GPU: the checks CPU-only CI cannot run, each printing its figures.
#   1. tests/gpu (the executor's CUDA path, memory tiers on CUDA streams, the profiler, calibration);
#   2. `tessera calibrate --device cuda` into OUT/calibrated-gpu.json;
#   3. plans made from that file (a GPT in bf16 with room to spare, the same GPT whose micro-batches
#      only fit with recompute, the same GPT at batch 2, whose optimizer step held more than its backward
#      (about 3 GiB of fp32 gradients and Adam temporaries) until the step went in buckets, the same GPT in
#      2 GB, which fits only sending its gradients to the host each backward (ZeRO-Offload), a ResNet-50),
#      costed from node times measured on this GPU (--profile; the file is this GPU's calibration), each
#      run by `tessera run` and compared with its predictions by `tessera validate` (step time, peak
#      memory against the CUDA allocator); the roofline's predicted step (without --profile) is printed
#      beside;
#   4. benchmarks/one_gpu.py: those plans' runtime against the plain PyTorch loop;
#   5. benchmarks/cuda_overlap.py: host-link bandwidth and copy/compute overlap on CUDA streams.
# Steps are independent: one failing does not stop the rest (each has a time limit).
# Run from the repository root: bash benchmarks/one_gpu_checks.sh [OUT_DIR]   (default ./gpu-checks)
# QUICK=1 skips steps 4 and 5 and the roofline plans; SKIP="roofline overlap" (any of roofline, eager,
# overlap) skips those parts alone.
set -u
[ -n "${QUICK:-}" ] && SKIP="roofline eager overlap"
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
tessera=(tessera)
command -v tessera > /dev/null || tessera=(python3 -m planner)  # not installed: run from the checkout
step() { echo; echo "=== $1 ($(date +%T))"; }
device="$out/calibrated-gpu.json"
gpt="--model-arg hidden=1536 --model-arg layers=12 --model-arg heads=16 --model-arg seq_len=1024
     --model-arg dropout=0.0 --input 1024:int64 --batch-size 32 --precision bf16"

step "versions"
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"

step "tests/gpu"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -15

step "calibrate"
timeout 120 "${tessera[@]}" calibrate --device cuda -o "$device"

plans=()
make_plan() {  # name, then tessera plan arguments
    local name=$1; shift
    step "plan $name"
    if timeout 180 "${tessera[@]}" plan "$@" --gpus 1 --device "$device" --profile -q -o "$out/$name.json"; then
        plans+=("$out/$name.json")
    fi
    if ! skip roofline; then
        timeout 120 "${tessera[@]}" plan "$@" --gpus 1 --device "$device" -q | grep "^step:" |
            sed 's/^/roofline /'
    fi
}
# shellcheck disable=SC2086  # $gpt is a list of arguments
make_plan gpt-bf16 examples/models/gpt.py:gpt $gpt --mem 80GB
# shellcheck disable=SC2086
make_plan gpt-bf16-recompute examples/models/gpt.py:gpt $gpt --mem 16GB --micro-batch-size 16
# shellcheck disable=SC2086
make_plan gpt-bf16-step examples/models/gpt.py:gpt $gpt --batch-size 2 --mem 80GB
# shellcheck disable=SC2086
make_plan gpt-bf16-grads examples/models/gpt.py:gpt $gpt --batch-size 8 --mem 2GB --optimizer adam \
    --offload recompute --offload host --offload grads
make_plan resnet50-bf16 examples/models/resnet.py:resnet50 --input 3x224x224 --batch-size 128 --mem 80GB \
    --precision bf16

for plan in "${plans[@]}"; do
    name=$(basename "$plan" .json)
    step "run and validate $name"
    timeout 180 "${tessera[@]}" run "$plan" --steps 8 -- --report "$out/$name-run.json" 2>&1 | tail -4
    timeout 60 "${tessera[@]}" validate "$plan" "$out/$name-run.json"
done

if ! skip eager; then
    step "runtime against the plain PyTorch loop"
    timeout 300 python3 benchmarks/one_gpu.py "${plans[@]}" --steps 30 --breakdown 12
fi
if ! skip overlap; then
    step "host link and copy/compute overlap"
    timeout 120 python3 benchmarks/cuda_overlap.py --device "$device"
fi
step "done"
