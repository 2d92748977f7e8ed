#!/bin/bash
# The label-skew switches' runs that need a many-core machine (docs/results.md, "Label skew"): one
# simulation per line of a run list, all at once, stopped at a deadline; the run folders are packed
# into $OUT/runs35.tgz, and `bench/paper.py PAPER --from-runs --work DIR/PAPER` summarises them anywhere.
# usage: bash bench/label_skew_runs.sh DEVICE DEADLINE_S RUNLIST [ROUNDS]
#   RUNLIST: one run per line, "paper|rounds|setting|method|seed" (rounds 0 = the config's; lines
#   starting with # are skipped), e.g. bench/configs/runs/label-skew.txt;
#   ROUNDS: a short smoke run of every line (0 or absent = each line's own).
#   JOBS=N in the environment runs at most N at once (default: all; on a small machine, its cores).
# Wheels in .whl/ (a machine without the package's dependencies) are installed first; data in .data/.
set -u
DEV=${1:-cuda}; DEADLINE=${2:-500}; LIST=${3:?a run list: paper|rounds|setting|method|seed per line}; SHORT=${4:-0}
[ -r "$LIST" ] || { echo "cannot read the run list $LIST"; exit 2; }
if [ -d .whl ] && [ -z "${NOWHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; export PYTHONPATH=/tmp/site; fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
W=/tmp/w35; rm -rf $W; mkdir -p $W/logs; OUTD=${OUT:-/tmp/out35}; mkdir -p $OUTD
DATA=.data/fashion-mnist
n=0; t0=$(date +%s)
while IFS='|' read -r paper rounds setting method seed; do
  case "$paper" in ''|'#'*) continue ;; esac
  while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-1000}" ]; do sleep 2; done
  extra=(); [ "$rounds" != 0 ] && extra=(--rounds "$rounds"); [ "$SHORT" != 0 ] && extra=(--rounds "$SHORT")
  work=$paper; [ "$rounds" != 0 ] && work=$paper$rounds
  python3 bench/paper.py "$paper" --data $DATA --device "$DEV" --threads 1 --settings "$setting" --methods "$method" \
    --seed "$seed" --seeds 1 --tag "s$seed" --work "$W/$work" --out "$W/json" "${extra[@]}" \
    > "$W/logs/$work-${method//[^A-Za-z0-9+]/_}-s$seed.log" 2>&1 < /dev/null &
  n=$((n + 1))
done < "$LIST"
echo "started $n runs"
while [ -n "$(jobs -r)" ] && [ $(( $(date +%s) - t0 )) -lt "$DEADLINE" ]; do sleep 5; done
echo "stopped after $(( $(date +%s) - t0 )) s; still running: $(jobs -r | wc -l)"
kill $(jobs -p) 2>/dev/null; sleep 2
nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
for f in $W/*/*/metrics.jsonl; do echo "$(wc -l < "$f") ${f#$W/}"; done
tar czf $OUTD/runs35.tgz -C $W --exclude='*.key' --exclude='*.pt' --exclude=json . 2>/dev/null
ls -la $OUTD
