#!/usr/bin/env bash
# The D=4 measurements two cores cannot make (issues 36 and 37), on a machine of at least 16 cores (a lent
# GPU host's CPUs: 4 workers x 4 threads, gloo), after gpu_check.sh on its GPU. Every figure it prints follows
# the hardware line of the script that took it.
#
#     OUT=/tmp/d4 bash bench/device_d4.sh     # about 12 min on 16 cores; logs in $OUT, run folders in $WORK
#
#   1 gpu_check.sh                                  (bench/gpu_check_results.md)
#   2 optimizer_placement.py --stages 4 (CUDA hidden: its workers fork from a parent that asked for the GPU), bert-mini widths with 8 layers (zb-v's 8 stages need 6+), 1f1b and
#     zb-v, every optimizer (NVLAMB, AdamW, Muon, K-FAC, EKFAC, PipeFisher; $PLACEMENT_OPTIMIZERS to choose), clip
#     1.0 (every stage deferred: the same work both ways, the noise) and clip 0, 8 rounds (a whole number of
#     PipeFisher's refresh cycles) (bench/studies/16-optimizer-placement.md)
#   3 validate_time_to_target.py --stages 4, 9 pairs ({1f1b, chimera, zb-h1} x {nvlamb, muon,
#     pipefisher}: of the schedules the search builds at pp=4 for bert-tiny's 2 layers and 4 micro-batches; $PAIRS
#     to choose others), one round (bench/studies/20-time-to-target-validation.md)
#   4 (with FUSED_S > 0) ns_spread.py --fused-adamw at D=2, clip 0: Muon with AdamW's half on torch's fused kernel
#     against NVLAMB (bench/studies/19-muon-off-critical-path.md)
# A step whose *_S limit is 0 is skipped (e.g. PLACEMENT_S=0).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d -t d4.XXXXXX)}"
mkdir -p "$OUT"
export WANDB_MODE=disabled PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK="${WORK:-/tmp/d4-work}"  # run folders; $OUT keeps the logs and the validation's tables only
mkdir -p "$WORK"
"$PY" -c "from pipefisher.hardware import describe_hardware; print(describe_hardware())"

step() {  # seconds, log name, command...
    local limit="$1" log="$2"; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$log" 2>&1
    echo "== $log: exit $? after $((SECONDS - t0)) s"
}
step "${GPU_CHECK_S:-200}" gpu_check.log env OUT="$WORK/gc" PYTHON="$PY" bash bench/gpu_check.sh
grep -E "^(gpu_check|CHECK)" "$OUT/gpu_check.log"
if [ "${PLACEMENT_S:-400}" -gt 0 ]; then
    # shellcheck disable=SC2086  # a list of arms
    step "${PLACEMENT_S:-400}" placement_d4.log env CUDA_VISIBLE_DEVICES= "$PY" bench/optimizer_placement.py --stages 4 \
        --models bert-mini --layers 8 --methods 1f1b zb-v \
        --optimizers ${PLACEMENT_OPTIMIZERS:-nvlamb adamw muon kfac ekfac pipefisher} --clips 1.0 0 \
        --micro-batches 8 --rounds "${PLACEMENT_ROUNDS:-8}" --warmup 2 --simulate-optimizers nvlamb
    grep -v "^|.*bert-\(medium\|large\)" "$OUT/placement_d4.log" | cut -c1-400 | tail -n 48
fi
pairs=$(for s in 1f1b chimera zb-h1; do for o in nvlamb muon pipefisher; do printf "%s/%s," $s $o; done; done)
if [ "${VALIDATE_S:-230}" -gt 0 ]; then
    step "${VALIDATE_S:-230}" validate_d4.log "$PY" bench/validate_time_to_target.py --out "$WORK/v4" --measure \
        --stages 4 --pairs "${PAIRS:-${pairs%,}}" --rounds 1 --steps 8
    grep -v "^refused by" "$OUT/validate_d4.log" | cut -c1-700 | tail -n 30
    cp "$WORK/v4/validation.json" "$WORK/v4/validation.md" "$WORK/v4/collectives-round0.json" "$OUT/" 2>/dev/null
fi
if [ "${FUSED_S:-0}" -gt 0 ]; then
    step "$FUSED_S" fused_adamw.log env CUDA_VISIBLE_DEVICES= "$PY" bench/ns_spread.py --methods 1f1b chimera --clips 0 \
        --rounds "${FUSED_ROUNDS:-8}" --fused-adamw
    cut -c1-400 "$OUT/fused_adamw.log" | tail -n 25
fi
