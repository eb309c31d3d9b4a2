#!/usr/bin/env bash
# Issue 29: does the relation's ceiling on clean position data (0.82-0.88 after 1,500 x 128 on the CPU)
# move with ~10x the pretraining compute and with width / depth? Four pretrainings side by side on one
# GPU, then the relation-holds split (tie_colour.py) of every snapshot and the probe of each final model.
# Usage: run.sh OUT [STEPS] [MINUTES] [DEVICE] [BATCH]   (defaults: 4000 steps, 4.5 min cap, cuda, batch 512)
# A smoke form on the CPU: run.sh /tmp/x 2 1 cpu 8
set -u
OUT=$1; STEPS=${2:-4000}; MIN=${3:-4.5}; DEV=${4:-cuda}; BATCH=${5:-512}
HERE=$(cd "$(dirname "$0")" && pwd); TIE=$HERE/../colour/tie_colour.py
W=${WORK:-/tmp/gpu_pretrain}; mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=3 HF_HUB_OFFLINE=1
EVERY=$(( STEPS / 4 > 0 ? STEPS / 4 : 1 ))
common="--batch $BATCH --lr 1e-3 --warmup $(( STEPS < 300 ? 1 : 300 )) --eval-every $EVERY --eval-prompts 12 \
  --device $DEV --threads 3 --minutes $MIN"
pos="--caption-noise position=0 --cell-offset-bias \
  --tag-weights single_object=0,two_object=0,counting=0,colors=0,color_attr=0,position=1"
train() {  # NAME STEPS ARGS...: pretrain, then the relation split of every snapshot and the probe of the last
  local name=$1 steps=$2; shift 2
  python -m flowgrpo.shapes.pretrain --out "$W/$name" --steps "$steps" $common "$@" > "$W/$name.log" 2>&1
  for snap in $(ls -d "$W/$name"/snapshots/step_* 2>/dev/null | sort -t_ -k2 -n); do
    python "$TIE" "$snap" 1 >> "$W/$name.tie.jsonl" 2>> "$W/$name.log"
  done
  python -m flowgrpo shapes probe --weights "$W/$name/snapshots/final" --out "$W/$name/probe" --threads 2 \
    >> "$W/$name.log" 2>&1
}
train clean_bias "$STEPS" $pos &
train clean_wide "$STEPS" $pos --heads 8 &
train clean_wide_deep $(( STEPS * 3 / 4 )) $pos --heads 8 --layers 12 &
train default_mix "$STEPS" &
wait
for n in clean_bias clean_wide clean_wide_deep default_mix; do
  echo "== $n"; tail -3 "$W/$n.log"; cat "$W/$n.tie.jsonl" 2>/dev/null | cut -c1-300
done
(cd "$W" && tar cf "$OUT/results.tar" *.log *.jsonl */pretrain_log.jsonl */pretrain_args.json */probe)
(cd "$W" && tar cf "$OUT/default_mix_final.tar" default_mix/snapshots/final)
(cd "$W" && tar cf "$OUT/clean_bias_final.tar" clean_bias/snapshots/final)
ls -la "$OUT"
