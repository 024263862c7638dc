#!/usr/bin/env bash
# Issue 13 on a file system with reflinks: the K=4 bench family copied onto a loop-mounted
# btrfs (root, losetup, btrfs-progs), bench/issue13.py run there, then how many of a 10%
# output's bytes share extents with the base. Removes the image and the mount at the end.
#   flock /tmp/mergepipe-heavy.lock bash bench/issue13_btrfs.sh [FAMILY] [OUT_JSON]
set -euo pipefail
cd "$(dirname "$0")/.."
family=${1:-bench/out/family-bench-k4}
result=${2:-bench/out/issue13-k4-btrfs.json}
img=/tmp/mp-btrfs.img mnt=/tmp/mp-btrfs
mkdir -p "$mnt"
truncate -s 14G "$img" && mkfs.btrfs -q "$img" && mount -o loop "$img" "$mnt"
trap 'umount "$mnt" 2>/dev/null; rm -f "$img"; rmdir "$mnt" 2>/dev/null || true' EXIT
mkdir -p "$mnt/family"
cp -r "$family"/base "$family"/expert_{0,1,2,3} "$mnt/family/"
sync
.venv/bin/python bench/issue13.py --family "$mnt/family" --k 4 --rounds 3 --budgets 100%,25%,10% \
    --ties-budgets 100%,10% --out "$mnt/out"
cp "$mnt/out/results.json" "$result"
rm -rf "$mnt/out/cache/merges"
.venv/bin/python -m mergepipe run "$mnt/out/configs/task_arithmetic-10pct.yaml" -q
sync
btrfs filesystem du -s "$mnt/out/runs/task_arithmetic-10pct" "$mnt/family/base"
