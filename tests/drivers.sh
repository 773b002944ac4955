#!/usr/bin/env bash
# The real-driver campaign (issue 29): on every CPU Vulkan driver set up here -- the system's
# lavapipe, Mesa 25's lavapipe unpacked by `./setup.sh --drivers` into .venv/drivers/mesa25, and
# SwiftShader from Debian's chromium -- run `vkdsl devices`, `vkdsl verify`, a shortened default
# job (one SFT step and one DPO step on small evaluation files, to its report), `vkdsl generate`
# and the bundle job (generate's kernels recorded, then run with no compiler), each driver
# selected by VK_ICD_FILENAMES. Prints one table row per driver and exits
# non-zero if any step fails on any driver. Not part of the suite (minutes per driver); CI runs it
# after the suite (.ci/run).
#
#     ./setup.sh --drivers && tests/drivers.sh [NAME...]      # names: lavapipe mesa25 swiftshader
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/.venv/bin
WORK=$(mktemp -d -t vkdsl-drivers-XXXXXX)
failed=0
# the logs stay when a driver failed (their folder is named at the end)
trap '[ "$failed" = 0 ] && rm -rf "$WORK" || echo "drivers: logs in $WORK" >&2' EXIT

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

rows=()
for name in "${@:-lavapipe mesa25 swiftshader}"; do
  for n in $name; do
    read -r icd libdir <<<"$(icd_of "$n")"
    if [ -z "${icd:-}" ] || [ ! -f "$icd" ]; then
      echo "drivers: $n is not set up here (./setup.sh --drivers); skipped" >&2
      rows+=("| $n | not set up | | | | | |")
      failed=1
      continue
    fi
    export VK_ICD_FILENAMES=$icd
    if [ "$libdir" != "-" ]; then export LD_LIBRARY_PATH=$libdir; else unset LD_LIBRARY_PATH; fi
    log=$WORK/$n.log
    : > "$log"
    step() {            # LABEL COMMAND...: run, time, keep the output; 0/3 (gates) count as ran
      local t0=$SECONDS
      "${@:2}" >>"$log" 2>&1
      local rc=$?
      echo "$1: exit $rc in $((SECONDS - t0)) s" >>"$log"
      echo "$((SECONDS - t0)) s$([ $rc -ne 0 ] && echo " (exit $rc)")"
      return $rc
    }
    echo "drivers: $n ($icd)" >&2
    dev=$("$BIN/vkdsl" devices 2>&1 | grep -m 1 "driver " | sed 's/^ *type [a-z]*, driver //')
    [ -n "$dev" ] || { dev="no device"; failed=1; }
    ver=$(step verify "$BIN/vkdsl" verify) || failed=1
    verified=$(sed -nE 's/^([0-9]+\/[0-9]+) rows passed(, ([0-9]+) not applicable)?.*cold ([0-9.]+ s).*warm ([0-9.]+ s).*/\1 passed, \3 n\/a, cold \4, warm \5/p' "$log" | tail -n 1)
    out=$WORK/$n-run
    train=$(step train "$BIN/vkdsl-train" --no-verify --steps 1 --warmup 1 --dpo-steps 1 \
        --heldout-file "$WORK/held.jsonl" --preservation-file "$WORK/pres.jsonl" \
        --dpo-train-file "$WORK/prefs.jsonl" --dpo-heldout-file "$WORK/prefs_held.jsonl" \
        --eval-batch 4 --stability-rows 2 --format-examples 1 --out "$out")
    rc=$?
    # one step does not pass every gate: what counts is that the job ran to its report
    if [ $rc -ne 0 ] && [ $rc -ne 3 ] || [ ! -f "$out/report.html" ]; then failed=1; train="$train FAILED"; fi
    gen=$(step generate "$BIN/vkdsl" generate --prompt "The capital of France is" \
        --max-new-tokens 8) || failed=1
    grep -q "Paris" "$log" || { failed=1; gen="$gen, no Paris"; }
    # the bundle job: generate's kernels recorded on this driver, then the same command with no
    # compiler anywhere (none forced, none on PATH, shipped SPIR-V off, an empty cache)
    b=$WORK/$n-bundle
    want=$("$BIN/vkdsl" generate --prompt "The capital of France is" --max-new-tokens 4 2>/dev/null)
    bundle=$(step bundle "$BIN/vkdsl" compile --bundle "$b" \
        --for "vkdsl generate --prompt 'The capital of France is' --max-new-tokens 4") || failed=1
    got=$(VKDSL_COMPILER=none VKDSL_SPIRV_BUNDLE=$b VKDSL_SPIRV_SHIPPED=0 \
          VKDSL_CACHE_DIR=$WORK/$n-empty-cache PATH=$BIN "$BIN/vkdsl" generate \
          --prompt "The capital of France is" --max-new-tokens 4 2>>"$log")
    rc=$?
    echo "offline generate: exit $rc: $got" >>"$log"
    if [ $rc -ne 0 ] || [ -z "$want" ] || [ "$got" != "$want" ]; then
      failed=1; bundle="$bundle, offline run FAILED"
    fi
    rows+=("| $n | $dev | $verified (all: $ver) | $train | $gen | $bundle |")
    tail -n 5 "$log" >&2
  done
done
echo "| driver | device (vkdsl devices) | verify | short default job | generate | bundle job |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $failed
