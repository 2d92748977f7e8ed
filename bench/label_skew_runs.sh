#!/bin/bash
# The label-skew switches' runs that need a many-core machine (docs/results.md, "Label skew"): one
# simulation per method and seed, all at once, stopped at a deadline; the run folders are packed into
# $OUT/runs35.tgz, and `bench/paper.py PAPER --from-runs --work DIR` summarises them anywhere.
#   the 300-round horizon of `paper.py noniid`, HeteroSFL's 16:1 setting (4 seeds of HeteroSFL 64x),
#   S2FL's Dirichlet 0.1 setting
# usage: bash bench/label_skew_runs.sh DEVICE DEADLINE_S [ROUNDS]   (ROUNDS: a short smoke run; 0 = the configs')
# Wheels in .whl/ (a machine without the package's dependencies) are installed first; data in .data/.
set -u
DEV=${1:-cuda}; DEADLINE=${2:-500}; SHORT=${3:-0}
if [ -d .whl ] && [ -z "${NOWHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; export PYTHONPATH=/tmp/site; fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
W=/tmp/w35; rm -rf $W; mkdir -p $W/logs; OUTD=${OUT:-/tmp/out35}; mkdir -p $OUTD
DATA=.data/fashion-mnist
r() {  # paper, work subdir, rounds (0 = config's), setting, method, seed
  local extra=(); [ "$3" != 0 ] && extra=(--rounds "$3"); [ "$SHORT" != 0 ] && extra=(--rounds "$SHORT")
  python3 bench/paper.py "$1" --data $DATA --device $DEV --threads 1 --settings "$4" --methods "$5" --seed "$6" --seeds 1 \
    --tag "s$6" --work "$W/$2" --out "$W/json" "${extra[@]}" > "$W/logs/$2-${5//[^A-Za-z0-9+]/_}-s$6.log" 2>&1 &
}
for s in 0 1; do
  for m in centralised FedAvg FedAvg+all MergeSFL MergeSFL+all; do r noniid noniid300 300 "a=0.1" "$m" $s; done
  for m in "S2FL+MB" "S2FL+MB+all"; do r s2fl s2fl 0 "a=0.1" "$m" $s; done
  for m in SFL "HeteroSFL 64x+all"; do r heterosfl heterosfl 0 "16:1" "$m" $s; done
done
for s in 0 1 2 3; do r heterosfl heterosfl 0 "16:1" "HeteroSFL 64x" $s; done
t0=$(date +%s)
while [ -n "$(jobs -r)" ] && [ $(( $(date +%s) - t0 )) -lt "$DEADLINE" ]; do sleep 5; done
echo "stopped after $(( $(date +%s) - t0 )) s; still running: $(jobs -r | wc -l)"
kill $(jobs -p) 2>/dev/null; sleep 2
nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
for f in $W/*/*/metrics.jsonl; do echo "$(wc -l < "$f") ${f#$W/}"; done
tar czf $OUTD/runs35.tgz -C $W --exclude='*.key' --exclude='*.pt' noniid300 s2fl heterosfl logs 2>/dev/null
ls -la $OUTD
