#!/bin/bash
# ab2.sh REPS LEVEL(v4|v3|v1) KERNELS(old,new) methods... : whole `mergepipe run` processes (a new merge each: the
# store's merges removed), alternated; prints level method kernel wall user+sys
reps=$1; lv=$2; kernels=$3; shift 3
suffix=""; [ "$lv" != v4 ] && suffix="_$lv"
for i in $(seq $reps); do for m in "$@"; do for k in ${kernels//,/ }; do
  rm -rf /tmp/i30/cache/merges /tmp/i30/out_$m
  PYTHONPATH=${SNAP:-/work/main} KLIB=/tmp/i30/$k$suffix.so /usr/bin/time -o /tmp/i30/t.txt -f "%e %U %S" \
    /work/main/.venv/bin/python /work/main/bench/issue30/runwith.py run /tmp/i30/$m.yaml -q >/dev/null 2>/tmp/i30/err.txt || { echo FAIL; tail -3 /tmp/i30/err.txt; }
  read e u s < /tmp/i30/t.txt; echo "$lv $m $k $e $(echo "$u + $s" | bc)"
done; done; done
