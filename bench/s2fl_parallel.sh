#!/usr/bin/env bash
# Run bench/s2fl.py as one process per (setting, method) in parallel, then merge the parts.
# Used for the published figures on a GPU server (16 cores, one GPU):
#   OUT=bench/results ROUNDS=40 DATA=/path/to/fashion-mnist bench/s2fl_parallel.sh
set -euo pipefail
OUT=${OUT:-bench/results}; ROUNDS=${ROUNDS:-40}; DATA=${DATA:-../shared/datasets/fashion-mnist}; DEVICE=${DEVICE:-auto}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
mkdir -p "$OUT/parts"
for s in a=0.1 a=0.5 IID; do for m in FedAvg SFL S2FL+B S2FL+M S2FL+MB; do
  tag="${s/=/}-$m"; tag="${tag/+/p}"
  python3 bench/s2fl.py --device "$DEVICE" --data "$DATA" --rounds "$ROUNDS" --settings "$s" --methods "$m" \
      --tag "$tag" --out "$OUT/parts" --work "/tmp/sfl-s2fl-$tag" --threads 1 > "$OUT/parts/$tag.log" 2>&1 &
done; done
wait
python3 bench/s2fl.py --merge "$OUT"/parts/s2fl-*.json --out "$OUT" --data "$DATA" --rounds "$ROUNDS"
