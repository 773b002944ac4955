#!/usr/bin/env bash
# The real-driver campaign (issue 29): on every CPU Vulkan driver set up here -- the system's
# lavapipe, Mesa 25's lavapipe unpacked by `./setup.sh --drivers` into .venv/drivers/mesa25, and
# SwiftShader from Debian's chromium -- run `vkdsl devices`, `vkdsl verify`, a shortened default
# job (one SFT step and one DPO step on small evaluation files, to its report), `vkdsl generate`
# and the bundle job (generate's kernels recorded, then run with no compiler), each driver
# selected by VK_ICD_FILENAMES, and `vkdsl doctor --json`. Prints the README's tested-drivers
# table (tests/drivers_table.py) and exits non-zero if any step fails on any driver. Not part of
# the suite (minutes per driver); CI runs it after the suite (.ci/run).
#
#     ./setup.sh --drivers && tests/drivers.sh [NAME...]      # names: lavapipe mesa25 swiftshader
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/.venv/bin
# DRIVERS_LOGS=DIR keeps each driver's log and doctor report there (to render the table again:
# tests/drivers_table.py DIR NAME...); otherwise they stay only when a driver failed
WORK=${DRIVERS_LOGS:-$(mktemp -d -t vkdsl-drivers-XXXXXX)}
mkdir -p "$WORK"
failed=0
trap '[ "$failed" = 0 ] && [ -z "${DRIVERS_LOGS:-}" ] && rm -rf "$WORK" \
      || echo "drivers: logs in $WORK" >&2' EXIT

# small evaluation files: the default job's data, cut to a few rows
D=train/data
head -n 8 $D/routing_heldout.jsonl > "$WORK/held.jsonl"
head -n 2 $D/preservation.jsonl > "$WORK/pres.jsonl"
head -n 8 $D/routing_prefs_train.jsonl > "$WORK/prefs.jsonl"
head -n 4 $D/routing_prefs_heldout.jsonl > "$WORK/prefs_held.jsonl"

icd_of() {              # NAME -> "ICD_FILE LIBRARY_DIR" (empty: not set up on this machine)
  case "$1" in
    lavapipe) f=$(ls /usr/share/vulkan/icd.d/lvp_icd*.json 2>/dev/null | head -n 1); echo "$f -" ;;
    mesa25) f=.venv/drivers/mesa25/icd.json
            [ -f "$f" ] && echo "$PWD/$f $(cat .venv/drivers/mesa25/libdir)" ;;
    swiftshader) f=/usr/lib/chromium/vk_swiftshader_icd.json; [ -f "$f" ] && echo "$f -" ;;
  esac
}

names=(${@:-lavapipe mesa25 swiftshader})
for n in "${names[@]}"; do
    read -r icd libdir <<<"$(icd_of "$n")"
    if [ -z "${icd:-}" ] || [ ! -f "$icd" ]; then
      echo "drivers: $n is not set up here (./setup.sh --drivers); skipped" >&2
      failed=1
      continue
    fi
    export VK_ICD_FILENAMES=$icd
    if [ "$libdir" != "-" ]; then export LD_LIBRARY_PATH=$libdir; else unset LD_LIBRARY_PATH; fi
    log=$WORK/$n.log
    : > "$log"
    step() {            # LABEL COMMAND...: run, time, keep the output (drivers_table.py reads it)
      local t0=$SECONDS
      "${@:2}" >>"$log" 2>&1
      local rc=$?
      echo "$1: exit $rc in $((SECONDS - t0)) s" >>"$log"
      return $rc
    }
    echo "drivers: $n ($icd)" >&2
    "$BIN/vkdsl" devices >>"$log" 2>&1 && grep -q "driver " "$log" || failed=1
    step verify "$BIN/vkdsl" verify || failed=1
    # the README's table row: the device, its driver version and the benchmarks, as doctor sees them
    step doctor bash -c '"$0" doctor --json >"$1"' "$BIN/vkdsl" "$WORK/$n.doctor.json" || failed=1
    out=$WORK/$n-run
    step train "$BIN/vkdsl-train" --no-verify --steps 1 --warmup 1 --dpo-steps 1 \
        --heldout-file "$WORK/held.jsonl" --preservation-file "$WORK/pres.jsonl" \
        --dpo-train-file "$WORK/prefs.jsonl" --dpo-heldout-file "$WORK/prefs_held.jsonl" \
        --eval-batch 4 --stability-rows 2 --format-examples 1 --out "$out"
    rc=$?
    # one step does not pass every gate: what counts is that the job ran to its report
    if [ $rc -ne 0 ] && [ $rc -ne 3 ] || [ ! -f "$out/report.html" ]; then failed=1; fi
    said=$WORK/$n.generated
    step generate bash -c '"$0" generate --prompt "The capital of France is" --max-new-tokens 4 \
        >"$1" && cat "$1" && grep -q Paris "$1"' "$BIN/vkdsl" "$said" || failed=1
    # the bundle job: generate's kernels recorded on this driver, then the same command with no
    # compiler anywhere (none forced, none on PATH, shipped SPIR-V off, an empty cache): same text
    b=$WORK/$n-bundle
    export WANT=$(cat "$said")
    step bundle "$BIN/vkdsl" compile --bundle "$b" \
        --for "vkdsl generate --prompt 'The capital of France is' --max-new-tokens 4" || failed=1
    step offline env VKDSL_COMPILER=none VKDSL_SPIRV_BUNDLE="$b" VKDSL_SPIRV_SHIPPED=0 \
        VKDSL_CACHE_DIR="$WORK/$n-empty-cache" PATH="$BIN" "$BIN/python" -c '
import os, subprocess, sys
got = subprocess.run([sys.argv[1], "generate", "--prompt", "The capital of France is",
                      "--max-new-tokens", "4"], stdout=subprocess.PIPE, text=True)
print("offline generate:", repr(got.stdout), "wanted", repr(os.environ["WANT"]))
same = got.stdout.strip() and got.stdout.rstrip("\n") == os.environ["WANT"]
sys.exit(got.returncode or not same)
' "$BIN/vkdsl" || failed=1
    tail -n 5 "$log" >&2
done
"$BIN/python" tests/drivers_table.py "$WORK" "${names[@]}"
exit $failed
