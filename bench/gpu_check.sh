#!/usr/bin/env bash
# The checks no CPU can make (issue 15). Run on a GPU node, from anywhere:
#
#     bash bench/gpu_check.sh            # needs >= 2 CUDA GPUs for the pipeline checks; ~10-20 min
#     OUT=/tmp/gc bash bench/gpu_check.sh  # where run folders go (default: a fresh mktemp -d)
#
# Each check prints one line "CHECK <name>: PASS|FAIL|SKIP <figure>" and the script ends with a
# summary; the exit status is 1 if any check failed or was skipped, 2 without CUDA.
#   1 nccl-equivalence-<method>  every registered pipeline method on NCCL (D=2, N=4, 3 steps, dropout 0):
#                                max |loss - loss of gpipe on gloo/CPU| over the steps (<= 2e-3)
#   2 bf16                       precision=bf16 on CUDA, 20 steps: first and last loss (finite, falling)
#   3 apex-fusedlamb             with apex importable: the optimizer line and the losses of 5 steps
#                                against the pure-PyTorch NVLAMB on CPU (max |d| <= 5e-3); SKIP without apex
#   4 profile-cuda               profile.py on CUDA (1f1b D=2): measured bubble utilization, and
#                                schedule.py's plan from that profile.sqlite
#   5 profile-nsys               with nsys on PATH: the same run under nsys, exported to SQLite and
#                                planned by schedule.py with gpu=auto (kernel time): its utilization
#   6 comm-ablation-nccl-<m>     comm_ablation=true on NCCL with optimizer=pipefisher (K-FAC factor
#                                all-reduces too): median step time, normal vs ablated, and the share
#   7 pipefisher-step-ratios     1f1b D=2 on CUDA: median step time of kfac and pipefisher / nvlamb
#   8 pipefisher-own-gpus        optimizer=pipefisher on min(4, GPUs) workers over NCCL (issue 25, defect 1: every
#                                worker ended up on cuda:0, a duplicate-GPU error or a hang): runs to the end
#   9 apex-checkpoint-on-cpu     with apex: a CUDA run stopped after its step-1 checkpoint resumes with device=cpu
#                                (pure-PyTorch NVLAMB; was KeyError 'step'); steps 2-3 vs the straight CUDA run
#  10 split-backward-bf16        one BERT-base layer's I under bf16 autocast on CUDA: storages filed for Q/K/V
#                                (1, was 3) and the MiB the store holds
#  11 refuse-gpus-shared         train.py with twice as many workers as GPUs: refused in one line before training
#  12 dead-worker-nccl           a worker SIGKILLed at step 2 under NCCL: seconds until the launcher exits
#                                (cluster.worker_timeout_s=600 must play no part)
#  13 memory-model-cuda          ONE GPU, stages=1, bert-mini and bert-medium, 4 steps each (< 1 min): the planner's
#                                predicted peak (planning.memory, device=cuda) within 25% of max_memory_allocated;
#                                max_memory_reserved and the memory outside the allocator shown beside it
#                                (bench/memory_model_cuda.py, bench/studies/15-memory-model.md); alone:
#                                python bench/memory_model_cuda.py
# Written and reviewed on a CPU-only machine; it has not run on a GPU yet (see issue 15's note).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python}"
export WANDB_MODE="${WANDB_MODE:-offline}"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False, CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-unset}');" \
         "run bench/gpu_check.sh on a GPU node" >&2
    exit 2
fi
NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())")"
OUT="${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$OUT"
echo "gpu_check: $NGPU GPU(s): $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))"); runs in $OUT"

# A small model that still gives the GPU work: bert-mini, seq 128, micro-batch 8.
MODEL=(model=bert-mini data.seq_len=128 micro_batch_size=8)
NODROP=(model.hidden_dropout=0.0 model.attention_dropout=0.0)
RESULTS=()
report() {  # name status figure
    echo "CHECK $1: $2 $3"
    RESULTS+=("$1: $2 $3")
}
run() {  # folder, then train.py/profile.py/schedule.py and its keys; output in <folder>.log
    local dir="$1"; shift
    "$PY" "$@" "hydra.run.dir=$dir" >"$dir.log" 2>&1
}
losses() {  # metrics.jsonl -> the losses, one line of JSON
    "$PY" -c "import json, sys; print(json.dumps([json.loads(l)['loss'] for l in open(sys.argv[1])]))" "$1/metrics.jsonl"
}
need_two() {
    if [ "$NGPU" -lt 2 ]; then report "$1" SKIP "(needs 2 GPUs, found $NGPU)"; return 1; fi
}

# 1. NCCL pipeline equivalence, every registered method --------------------------------------------
if need_two nccl-equivalence; then
    REF="$OUT/ref-gloo"
    if run "$REF" train.py device=cpu pipeline=gpipe stages=2 num_micro_batches=4 steps=3 "${MODEL[@]}" "${NODROP[@]}"; then
        for m in $("$PY" -c "from pipefisher.schedules import GENERATORS; print(' '.join(GENERATORS))"); do
            dir="$OUT/eq-$m"
            if run "$dir" train.py device=cuda "pipeline=$m" stages=2 num_micro_batches=4 steps=3 "${MODEL[@]}" "${NODROP[@]}"; then
                figure="$("$PY" -c "
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:])
d = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float('inf')
print(('PASS' if d <= 2e-3 else 'FAIL') + f' max|dloss| vs gpipe on gloo/CPU = {d:.2e} over {len(a)} steps')" \
                    "$(losses "$dir")" "$(losses "$REF")")"
                report "nccl-equivalence-$m" "${figure%% *}" "${figure#* }"
            else
                report "nccl-equivalence-$m" FAIL "(train.py failed: $(tail -n 1 "$dir.log"))"
            fi
        done
    else
        report nccl-equivalence FAIL "(the gloo reference failed: $(tail -n 1 "$REF.log"))"
    fi
fi

# 2. bf16 -------------------------------------------------------------------------------------------
dir="$OUT/bf16"
if run "$dir" train.py device=cuda precision=bf16 stages=1 pipeline=gpipe num_micro_batches=2 steps=20 "${MODEL[@]}"; then
    figure="$("$PY" -c "
import json, math, sys
l = json.loads(sys.argv[1])
ok = all(math.isfinite(x) for x in l) and l[-1] < l[0]
print(('PASS' if ok else 'FAIL') + f' loss {l[0]:.3f} -> {l[-1]:.3f} over {len(l)} steps')" "$(losses "$dir")")"
    report bf16 "${figure%% *}" "${figure#* }"
else
    report bf16 FAIL "(train.py failed: $(tail -n 1 "$dir.log"))"
fi

# 3. apex FusedLAMB ---------------------------------------------------------------------------------
if "$PY" -c "import apex.optimizers" 2>/dev/null; then
    gpu="$OUT/apex-gpu"; cpu="$OUT/apex-cpu"
    if run "$gpu" train.py device=cuda stages=1 pipeline=gpipe num_micro_batches=2 steps=5 "${MODEL[@]}" "${NODROP[@]}" \
        && run "$cpu" train.py device=cpu stages=1 pipeline=gpipe num_micro_batches=2 steps=5 "${MODEL[@]}" "${NODROP[@]}"; then
        line="$(grep -m1 -o "optimizer: .*" "$gpu.log" || echo 'no optimizer line')"
        figure="$("$PY" -c "
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:])
d = max(abs(x - y) for x, y in zip(a, b))
print(('PASS' if d <= 5e-3 else 'FAIL') + f' max|dloss| vs pure-PyTorch NVLAMB on CPU = {d:.2e}')" "$(losses "$gpu")" "$(losses "$cpu")")"
        case "$line" in *FusedLAMB*) report apex-fusedlamb "${figure%% *}" "${figure#* } [$line]";;
                        *) report apex-fusedlamb FAIL "(apex imports but the run did not use it: $line)";; esac
    else
        report apex-fusedlamb FAIL "(train.py failed: $(tail -n 1 "$gpu.log") $(tail -n 1 "$cpu.log"))"
    fi
else
    report apex-fusedlamb SKIP "(apex is not installed: pip install from https://github.com/NVIDIA/apex)"
fi

# 4. a profile on CUDA, and a plan from it --------------------------------------------------------
if need_two profile-cuda; then
    dir="$OUT/profile-cuda"
    if run "$dir" profile.py device=cuda pipeline=1f1b stages=2 num_micro_batches=4 steps=4 "${MODEL[@]}"; then
        util="$(grep -m1 -o "overall bubble utilization .*" "$dir.log")"
        if run "$OUT/plan-cuda" schedule.py "from=$dir/profile.sqlite"; then
            report profile-cuda PASS "$util; plan: $(grep -m1 -o "measured in the profile: [^,]*" "$OUT/plan-cuda.log")"
        else
            report profile-cuda FAIL "$util; schedule.py failed: $(tail -n 1 "$OUT/plan-cuda.log")"
        fi
        [ -s "$dir/timeline.json" ] || report timeline-json FAIL "(no $dir/timeline.json)"
    else
        report profile-cuda FAIL "(profile.py failed: $(tail -n 1 "$dir.log"))"
    fi
fi

# 5. the same run under nsys: per-process ranges, kernels, schedule.py with gpu=auto ---------------
if command -v nsys >/dev/null && need_two profile-nsys; then
    dir="$OUT/nsys"; mkdir -p "$dir"
    if nsys profile --trace=cuda,nvtx --output="$dir/report" --force-overwrite=true \
            "$PY" profile.py device=cuda pipeline=1f1b stages=2 num_micro_batches=4 steps=4 "${MODEL[@]}" \
            "hydra.run.dir=$dir/run" >"$dir.log" 2>&1 \
        && nsys export --type=sqlite --force-overwrite=true --output="$dir/report.sqlite" "$dir/report.nsys-rep" >>"$dir.log" 2>&1 \
        && run "$OUT/plan-nsys" schedule.py "from=$dir/report.sqlite" model=bert-mini data.seq_len=128 micro_batch_size=8; then
        report profile-nsys PASS "$(grep -m1 -o "measured in the profile: [^,]*" "$OUT/plan-nsys.log"); $(grep -m1 -o "costs: .*kernel time[^;]*" "$OUT/plan-nsys.log" || echo 'CPU ranges: no kernels found')"
    else
        report profile-nsys FAIL "(see $dir.log / $OUT/plan-nsys.log: $(tail -n 1 "$OUT/plan-nsys.log" 2>/dev/null))"
    fi
elif ! command -v nsys >/dev/null; then
    report profile-nsys SKIP "(nsys is not on PATH)"
fi

# 6. comm_ablation on NCCL ----------------------------------------------------------------------------
median_step() {  # metrics folder -> median step_time_s after the first 2 steps
    "$PY" -c "
import json, statistics, sys
t = [json.loads(l)['step_time_s'] for l in open(sys.argv[1] + '/metrics.jsonl')][2:]
print(statistics.median(t))" "$1"
}
if need_two comm-ablation-nccl; then
    for m in gpipe 1f1b chimera; do
        a="$OUT/abl-$m-normal"; b="$OUT/abl-$m-ablated"
        if run "$a" train.py device=cuda optimizer=pipefisher "pipeline=$m" stages=2 num_micro_batches=4 steps=12 "${MODEL[@]}" \
            && run "$b" train.py device=cuda optimizer=pipefisher "pipeline=$m" stages=2 num_micro_batches=4 steps=12 \
                comm_ablation=true "${MODEL[@]}"; then
            report "comm-ablation-nccl-$m" PASS "$("$PY" -c "
import sys
n, x = map(float, sys.argv[1:])
print(f'step {n * 1e3:.1f} ms normal, {x * 1e3:.1f} ms ablated: communication share {1 - x / n:+.1%}')" \
                "$(median_step "$a")" "$(median_step "$b")")"
        else
            report "comm-ablation-nccl-$m" FAIL "(train.py failed: $(tail -n 1 "$b.log"))"
        fi
    done
fi

# 7. PipeFisher step ratios on GPU ------------------------------------------------------------------
if need_two pipefisher-step-ratios; then
    declare -A T=()
    ok=1
    for opt in nvlamb kfac pipefisher; do
        dir="$OUT/ratio-$opt"
        if run "$dir" train.py device=cuda "optimizer=$opt" pipeline=1f1b stages=2 num_micro_batches=4 steps=12 "${MODEL[@]}"; then
            T[$opt]="$(median_step "$dir")"
        else
            ok=0; report pipefisher-step-ratios FAIL "(optimizer=$opt failed: $(tail -n 1 "$dir.log"))"; break
        fi
    done
    if [ "$ok" = 1 ]; then
        report pipefisher-step-ratios PASS "$("$PY" -c "
import sys
n, k, p = map(float, sys.argv[1:])
print(f'nvlamb {n * 1e3:.1f} ms; kfac {k / n:.2f}x; pipefisher {p / n:.2f}x of nvlamb (median of steps 2-11)')" \
            "${T[nvlamb]}" "${T[kfac]}" "${T[pipefisher]}")"
    fi
fi

# 8-12. issue 25: the CUDA path's fixes -----------------------------------------------------------
if need_two pipefisher-own-gpus; then
    w=$(( NGPU < 4 ? NGPU : 4 )); w=$(( w / 2 * 2 ))
    dir="$OUT/own-gpus"
    if timeout 900 "$PY" train.py device=cuda optimizer=pipefisher pipeline=1f1b "stages=$w" "num_micro_batches=$w" \
            steps=4 model=bert-mini "model.num_layers=$w" data.seq_len=128 micro_batch_size=8 cluster.worker_timeout_s=120 \
            "hydra.run.dir=$dir" >"$dir.log" 2>&1; then
        report pipefisher-own-gpus PASS "($w workers, 4 steps on NCCL)"
    else
        report pipefisher-own-gpus FAIL "($(grep -m1 -io "duplicate gpu[^.]*\|timed out[^.]*" "$dir.log" || tail -n 1 "$dir.log"))"
    fi
fi

if "$PY" -c "import apex.optimizers" 2>/dev/null; then
    a="$OUT/apex-straight"; b="$OUT/apex-moved"
    common=(stages=1 pipeline=gpipe num_micro_batches=2 steps=4 checkpoint.every_steps=2 "${MODEL[@]}" "${NODROP[@]}")
    run "$a" train.py device=cuda "${common[@]}"
    run "$b" train.py device=cuda "${common[@]}" fault.mode=raise fault.rank=0 fault.step=2
    if run "$b" train.py device=cpu "${common[@]}" resume=auto; then
        figure="$("$PY" -c "
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:])
d = max(abs(x - y) for x, y in zip(a[2:], b[2:])) if len(a) == len(b) == 4 else float('inf')
print(('PASS' if d <= 5e-3 else 'FAIL') + f' steps 2-3 resumed on CPU vs straight on CUDA: max|dloss| = {d:.2e}')" \
            "$(losses "$a")" "$(losses "$b")")"
        report apex-checkpoint-on-cpu "${figure%% *}" "${figure#* }"
    else
        report apex-checkpoint-on-cpu FAIL "(resume on CPU failed: $(tail -n 1 "$b.log"))"
    fi
else
    report apex-checkpoint-on-cpu SKIP "(apex is not installed)"
fi

figure="$("$PY" - <<'PYEOF' 2>&1 | tail -n 1
import torch
from pipefisher.model import BertConfig, build_full_model
from pipefisher.data.synthetic import SyntheticSource
from pipefisher.runtime.split_backward import deferring, enable_split_backward
config = BertConfig(num_layers=1, hidden_size=768, num_heads=12, hidden_dropout=0.0, attention_dropout=0.0)
model = build_full_model(config, seed=0).cuda()
enable_split_backward([model])
batch = {k: v.cuda() for k, v in SyntheticSource(seq_len=128, max_predictions=20, vocab_size=config.vocab_size,
                                                 seed=0).get_samples(range(8)).items()}
with deferring([]) as store:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(None, batch).sum()
    loss.backward()
att = model.bert.encoder.layer["0"].attention.self
qkv = {id(att.query.weight), id(att.key.weight), id(att.value.weight)}
n = len({x.untyped_storage().data_ptr() for p, _, x in store if id(p) in qkv})
held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, g, x in store for t in (g, x)}
print(("PASS" if n == 1 else "FAIL") + f" Q/K/V inputs in {n} storage(s); the store holds {sum(held.values()) / 2**20:.1f} MiB")
PYEOF
)"
report split-backward-bf16 "${figure%% *}" "${figure#* }"

dir="$OUT/refuse-shared"
"$PY" train.py device=cuda pipeline=gpipe "stages=$(( NGPU * 2 ))" "num_micro_batches=$(( NGPU * 2 ))" \
    "model.num_layers=$(( NGPU * 2 ))" steps=1 "hydra.run.dir=$dir" >"$dir.log" 2>&1
if grep -q "workers on this node but $NGPU GPU" "$dir.log"; then
    report refuse-gpus-shared PASS "($(grep -m1 -o "workers on this node but [^;]*" "$dir.log"))"
else
    report refuse-gpus-shared FAIL "($(tail -n 1 "$dir.log"))"
fi

if need_two dead-worker-nccl; then
    dir="$OUT/dead-worker"; start=$(date +%s)
    "$PY" train.py device=cuda pipeline=1f1b stages=2 num_micro_batches=4 steps=6 fault.mode=kill fault.rank=1 \
        fault.step=2 cluster.worker_timeout_s=600 "${MODEL[@]}" "hydra.run.dir=$dir" >"$dir.log" 2>&1
    rc=$?; took=$(( $(date +%s) - start ))
    if [ "$rc" -ne 0 ] && [ "$took" -lt 120 ]; then
        report dead-worker-nccl PASS "(launcher exited $rc after ${took} s)"
    else
        report dead-worker-nccl FAIL "(exit $rc after ${took} s: $(tail -n 1 "$dir.log"))"
    fi
fi

# 13. the memory model against one GPU's caching allocator ----------------------------------------------
figure="$("$PY" bench/memory_model_cuda.py 2>"$OUT/memory-model-cuda.log" | tail -n 1)"
case "$figure" in
    PASS*|FAIL*) report memory-model-cuda "${figure%% *}" "${figure#* }";;
    *) report memory-model-cuda FAIL "(no result: $(tail -n 1 "$OUT/memory-model-cuda.log"))";;
esac

echo "gpu_check summary ($OUT):"
status=0
for r in "${RESULTS[@]}"; do
    echo "  $r"
    case "$r" in *": FAIL"*|*": SKIP"*) status=1;; esac
done
exit "$status"
