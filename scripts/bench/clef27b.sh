#!/usr/bin/env bash
# Clef (27B) on one H200 (issue 15, target 4): the `--preset 27b` fixture (Qwen3.5-27B shapes, random weights),
# then SystemOne, generate, `blaze edit` and `blaze canary`, each timed, with the peak GPU memory of each
# section (results.json: peak_gpu_gib). Each stage is one device command that stops itself before 10 minutes
# (timeout -s INT: the sections finished so far, and the edit's stages so far, are still written to OUT).
#
# Run from the repository root on the device, after the usual wheel install and PYTHONPATH export:
#   bash scripts/bench/clef27b.sh serve  OUT   # fixture if missing (55.6 GB), env, systemone, generate
#   bash scripts/bench/clef27b.sh edit   OUT   # blaze edit, fixed strength, --no-canary (stages timed)
#   bash scripts/bench/clef27b.sh canary OUT   # blaze canary on the edit's variant (same warm machine)
#
# Disk: the fixture is 55.6 GB and the device disk 64 GiB, so a variant (another 55.6 GB) cannot sit next to
# the base. The edit writes its variant to /dev/shm when that has room (it is RAM: 128 GiB on the device);
# otherwise to the disk, where the write stops at "no space left" after load, statistics and solve are timed
# (blaze then removes its partial output). blaze has no patch-only edit (`blaze edit` always writes a variant).
set -euo pipefail
stage=${1:?"stage: serve | edit | canary"}
out=${2:?"output folder"}
work=${BLAZE_BENCH_WORK:-/tmp/bench27}
export BLAZE_QUIET=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 BLAZE_CACHE=${BLAZE_CACHE:-$work/cache}
mkdir -p "$work" "$out"
df -B1 "$work" /dev/shm 2>&1 | tee "$out/disk.txt" || true
# BLAZE_BENCH_PRESET / BLAZE_BENCH_ARGS: a smoke test of the script itself, e.g. tiny + "--device cpu"
read -r -a extra <<< "${BLAZE_BENCH_ARGS:-}"
common=(--workdir "$work" --preset "${BLAZE_BENCH_PRESET:-27b}" --model edit-base "${extra[@]}")
limit=${BLAZE_BENCH_LIMIT_S:-585}

variant=$work/variant
shm_free=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1 || true)
if [ -d /dev/shm/variant27b ] || [ "${shm_free:-0}" -gt 58000000000 ] 2>/dev/null; then
    variant=/dev/shm/variant27b
fi

case $stage in
serve)
    timeout -s INT "$limit" python3 -m scripts.bench --out "$out" "${common[@]}" --sections env,systemone,generate \
        --s1-repeats 20 --s1-warmup 3 --s1-agree 5 --gen-batches 16 --fast-extra-batches "" || echo "exit $?"
    ;;
edit)
    echo "variant folder: $variant" | tee -a "$out/disk.txt"
    timeout -s INT "$limit" python3 -m scripts.bench --out "$out" "${common[@]}" --variant-dir "$variant" \
        --sections edit --edit-args "--strength 0.15 --no-canary" || echo "exit $?"
    rm -rf "$work"/.variant.tmp-*  # a write stopped by a full disk or the time limit (blaze removes it itself on errors)
    df -B1 "$work" /dev/shm 2>&1 | tee -a "$out/disk.txt" || true
    ;;
canary)
    timeout -s INT "$limit" python3 -m scripts.bench --out "$out" "${common[@]}" --variant-dir "$variant" \
        --sections canary || echo "exit $?"
    ;;
*)
    echo "unknown stage $stage: serve | edit | canary" >&2
    exit 2
    ;;
esac
