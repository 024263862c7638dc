#!/bin/bash
# Old-vs-new engine A/B: bench/phases.py from two git worktrees, alternated old/new, 3 rounds.
#
#   git worktree add --detach /tmp/wt_old OLD_COMMIT; git worktree add --detach /tmp/wt_new NEW_COMMIT
#   WT_OLD=/tmp/wt_old WT_NEW=/tmp/wt_new bench/ab_phases.sh OUT.txt ta.yaml:full ta.yaml:10% ties.yaml:full
#
# One line per run in OUT.txt: version config budget TIME wall user sys, the in-process total and
# the load average; each run's phase JSON in OUT.txt.json. PYTHONPATH makes each run import its
# worktree's mergepipe (the venv's editable install points at this checkout).
set -eu
out=$1; shift
py=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
for r in 1 2 3; do for spec in "$@"; do cfg=$(realpath "${spec%:*}"); b=${spec#*:}; for v in old new; do
  wt=$([ $v = old ] && echo "$WT_OLD" || echo "$WT_NEW")
  log=$(mktemp)
  res=$(cd "$wt" && { /usr/bin/time -f "TIME %e %U %S" env PYTHONPATH="$wt" "$py" bench/phases.py "$cfg" --budget "$b" > "$log"; } 2>&1 | grep TIME)
  tot=$(grep -o "total [0-9.]*" "$log" | cut -d' ' -f2)
  echo "$v $(basename "$cfg" .yaml) $b $res total_in_process $tot load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out"
  grep '^{' "$log" | sed "s/^/JSON $v $(basename "$cfg" .yaml) $b /" >> "$out.json"
  rm -f "$log"
done; done; done
