#!/usr/bin/env bash
# One command for a machine with N GPUs (sized for 10 minutes on 8): the CUDA
# correctness checks, then keras-dtensor against native torch (training
# steps, Gemma generate, checkpoint save/load), then one table of ratios,
# DIR/summary.md. Each stage logs to DIR/<stage>.log; a failed stage is named
# at the end and the exit status is 1.
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--nproc N] [--out DIR]
#                        [--rounds R] [--quick]
#
# --nproc defaults to the visible GPUs (one process each). --device cpu runs
# the same stages over gloo; with --quick (tiny steps) tests/test_gpu_check.py
# runs it.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
device=cuda nproc="" out=gpu_check-$(date +%Y%m%d-%H%M%S) rounds=1 quick=0
while (($#)); do
  case $1 in
    --device) device=$2; shift 2 ;;
    --nproc) nproc=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    *) sed -n 8,9p "$0" >&2; exit 2 ;;
  esac
done
[[ $device =~ ^(cuda|cpu)$ ]] || { sed -n 8,9p "$0" >&2; exit 2; }
export KERAS_BACKEND=torch OMP_NUM_THREADS=1
if [[ $device == cuda ]]; then
  gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
  if ((gpus < 1)); then
    echo "no GPU visible (--device cpu runs the same stages on CPU)" >&2
    exit 2
  fi
  nproc=${nproc:-$gpus}
  if ((nproc > gpus)); then
    echo "--nproc $nproc: one GPU a process, $gpus GPUs visible" >&2
    exit 2
  fi
else
  nproc=${nproc:-2}
fi
# Batches (the transformer's is 8) and heads (4) split evenly: the
# data-parallel and FSDP variants run on the largest power of two <= N (at
# most 8), the tensor-parallel ones on at most 4.
dp=1
while ((dp * 2 <= nproc && dp < 8)); do dp=$((dp * 2)); done
tp=$((dp < 4 ? dp : 4))
if ((quick)); then
  models=transformer_small steps=(--steps 2 --warmup 1)
  calls=1 ckpt=(--rounds 1 --vocab 1000)
else
  models=mlp,transformer,transformer_small steps=(--steps 15 --warmup 5)
  calls=2 ckpt=(--rounds 2)
fi
mkdir -p "$out"
(cd "$out" && rm -f step.json step_tp.json generate.json checkpoint.json)
echo "device $device, $nproc processes: data-parallel and FSDP on $dp," \
  "tensor-parallel on $tp; logs in $out"

failed=()
stage() { # stage NAME COMMAND...: run it, log it, time it, note a failure
  local name=$1 start=$SECONDS
  shift
  echo "== $name: $*"
  if timeout 900 "$@" 2>&1 | tee "$out/$name.log"; then
    echo "== $name ok ($((SECONDS - start)) s)"
  else
    echo "== $name FAILED ($((SECONDS - start)) s): $out/$name.log"
    failed+=("$name")
  fi
}

if [[ $device == cuda ]]; then
  stage cuda_check "$PYTHON" -m torch.distributed.run --standalone \
    --nproc_per_node="$dp" "$root/scripts/cuda_check.py"
else
  echo "== cuda_check: skipped (--device cpu)"
fi
step=("$PYTHON" "$root/benchmarks/bench_step.py" --device "$device"
  --rounds "$rounds" --models "$models" "${steps[@]}")
stage step "${step[@]}" --nproc "$dp" --out "$out/step.json" \
  --variants torch_single,keras_single,torch_ddp,kd_dp,torch_fsdp2,kd_fsdp
stage step_tp "${step[@]}" --nproc "$tp" --out "$out/step_tp.json" \
  --variants torch_tp,kd_mp
stage generate "$PYTHON" "$root/benchmarks/bench_generate.py" \
  --device "$device" --nproc "$tp" --rounds "$rounds" --calls "$calls" \
  --out "$out/generate.json"
stage checkpoint "$PYTHON" "$root/benchmarks/bench_checkpoint.py" \
  --device "$device" --nproc "$dp" "${ckpt[@]}" --out "$out/checkpoint.json"
stage report "$PYTHON" "$root/scripts/gpu_check_report.py" "$out" \
  --models "$models" --header "device $device, $nproc processes\
 (data-parallel/FSDP $dp, tensor-parallel $tp), $(date -u +%FT%TZ)"

echo "total $SECONDS s; summary: $out/summary.md"
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]} (logs in $out)" >&2
  exit 1
fi
