#!/usr/bin/env bash
# One command for a machine with N GPUs (sized for 10 minutes on 8): the CUDA
# correctness checks, then keras-dtensor against native torch (training
# steps, Gemma generate, checkpoint save/load), then one table of ratios,
# DIR/summary.md. Each stage logs to DIR/<stage>.log; a failed stage is named
# at the end and the exit status is 1.
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--nproc N] [--out DIR]
#                        [--rounds R] [--quick | --smoke] [--help]
#
# --nproc defaults to the visible GPUs (one process each). --device cpu runs
# the same stages over gloo. --quick: every row, tiny steps (minutes on 2
# cores; tests/test_gpu_check.py's slow test). --smoke: the fewest launches
# that run the step and checkpoint stages and the report end to end, not a
# measurement (about half a minute on 2 cores; the suite runs it with
# --device cpu): one round; bench_step on transformer_small, only torch_ddp
# against kd_dp, 1 step; bench_checkpoint on a 100-word vocabulary; no
# generate (it cannot run fewer than its 4 launches). The rows it leaves
# out read "not run (smoke)" in the summary; a row it ran without numbers,
# or a failed stage, still exits 1.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
device=cuda nproc="" out=gpu_check-$(date +%Y%m%d-%H%M%S) rounds=1 quick=0
smoke=0
usage() { sed -n '8,9s/^# //p' "$0" >&2; exit 2; }
while (($#)); do
  case $1 in
    --device) device=$2; shift 2 ;;
    --nproc) nproc=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --smoke) smoke=1; shift ;;
    -h | --help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) usage ;;
  esac
done
[[ $device =~ ^(cuda|cpu)$ ]] || usage
((quick + smoke < 2)) || usage
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
# What each mode runs. not_run: the summary's rows a mode leaves out on
# purpose (stage or stage:numerator, gpu_check_report.py --smoke).
variants=torch_single,keras_single,torch_ddp,kd_dp,torch_fsdp2,kd_fsdp
tp_variants=torch_tp,kd_mp generate=1 not_run=""
if ((smoke)); then
  # Each benchmark variant is a fresh torchrun launch that imports torch
  # and Keras (5-10 s on 2 cores), so smoke keeps the launches to three:
  # one distributed pair (bench_step's torch and Keras workers, gloo, its
  # targets JSON) and bench_checkpoint (one launch for kd and DCP). The
  # tensor-parallel and FSDP pairs only repeat that driver with other
  # layouts, which the suite tests directly. generate is left out:
  # bench_generate has no flag to run fewer than its 7 variants (7
  # launches, ~90 s on 2 cores, more than smoke's whole budget), and what
  # it would cover of keras-dtensor, keras_hub's Gemma generate under
  # ModelParallel on 2 processes, tests/test_keras_hub.py already runs;
  # its driver and JSON stay covered by --quick (the slow test).
  rounds=1 models=transformer_small steps=(--steps 1 --warmup 1)
  variants=torch_ddp,kd_dp tp_variants="" generate=0
  ckpt=(--rounds 1 --vocab 100)
  not_run=step:keras_single,step:kd_mp,step:kd_fsdp,generate
elif ((quick)); then
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
  --variants "$variants"
if [[ -n $tp_variants ]]; then
  stage step_tp "${step[@]}" --nproc "$tp" --out "$out/step_tp.json" \
    --variants "$tp_variants"
else
  echo "== step_tp: skipped (--smoke)"
fi
if ((generate)); then
  stage generate "$PYTHON" "$root/benchmarks/bench_generate.py" \
    --device "$device" --nproc "$tp" --rounds "$rounds" --calls "$calls" \
    --out "$out/generate.json"
else
  echo "== generate: skipped (--smoke)"
fi
stage checkpoint "$PYTHON" "$root/benchmarks/bench_checkpoint.py" \
  --device "$device" --nproc "$dp" "${ckpt[@]}" --out "$out/checkpoint.json"
header="device $device, $nproc processes (data-parallel/FSDP $dp,\
 tensor-parallel $tp), $(date -u +%FT%TZ)"
if ((smoke)); then header+="; smoke: 1 step, not a measurement"; fi
stage report "$PYTHON" "$root/scripts/gpu_check_report.py" "$out" \
  --models "$models" --smoke "$not_run" --header "$header"

echo "total $SECONDS s; summary: $out/summary.md"
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]} (logs in $out)" >&2
  exit 1
fi
