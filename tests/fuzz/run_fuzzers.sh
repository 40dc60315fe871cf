#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan + coverage on the parsers' libraries, in
# build-fuzz/) and runs each for a bounded time.
#
#   tests/fuzz/run_fuzzers.sh [-t SECONDS] [--no-build] [--save-corpus] [TARGET...]
#
#   -t SECONDS      time per target (default 60)
#   TARGET          any of: safetensors jobspec hf_config dataset tokenizer submit worker_reports
#                   (default: all)
#   --no-build      reuse build-fuzz as it is
#   --save-corpus   merge the coverage-minimized working corpus into the checked-in one
#
# Corpora: tests/fuzz/corpus/<target>/ holds the checked-in seeds (read, never written unless
# --save-corpus); new inputs accumulate in build-fuzz/corpus/<target>/ across runs. Crashes,
# leaks, timeouts and out-of-memory inputs go to tests/fuzz/crashes/<target>/ (crash-<sha1>,
# ...): keep the ones that found bugs, they are the reproducers, and the script replays every
# file there first (so a fixed bug stays fixed). Run one: build-fuzz/bin/<target>_fuzz FILE.
# Logs: build-fuzz/fuzz-logs/<target>.log. Exit status 1 when any target failed.
#
# Environment: CC/CXX (default clang-14/clang++-14), JOBS (build parallelism, default 2),
# SLIDEDP_FUZZ_CMAKE_ARGS (extra configure arguments, e.g. -DSLIDEDP_SKIP_DIRS=tools/verify).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="$root/build-fuzz"
seconds=60
do_build=1
save_corpus=0
targets=()
all_targets=(safetensors jobspec hf_config dataset tokenizer submit worker_reports)

while [[ $# -gt 0 ]]; do
  case "$1" in
    -t) seconds="$2"; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --save-corpus) save_corpus=1; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "run_fuzzers.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[[ ${#targets[@]} -eq 0 ]] && targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "run_fuzzers.sh: unknown target $t (${all_targets[*]})" >&2; exit 2; }
done

export CC="${CC:-clang-14}" CXX="${CXX:-clang++-14}"
if [[ $do_build -eq 1 ]]; then
  # Instrument every library for coverage and the sanitizers, not only the fuzz entry points:
  # otherwise libFuzzer is blind inside the parsers it is meant to explore.
  san="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build" -G Ninja -DSLIDEDP_FUZZ=ON -DSLIDEDP_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" \
    -DCMAKE_C_FLAGS="$san" -DCMAKE_CXX_FLAGS="$san" ${SLIDEDP_FUZZ_CMAKE_ARGS:-} >"/tmp/slidedp-fuzz-configure.$$.log" 2>&1 ||
    { tail -30 "/tmp/slidedp-fuzz-configure.$$.log"; exit 1; }
  rm -f "/tmp/slidedp-fuzz-configure.$$.log"
  cmake --build "$build" -j "${JOBS:-2}" --target "${targets[@]/%/_fuzz}"
fi

export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
mkdir -p "$build/fuzz-logs"
found=0
printf '%-12s %10s %8s %8s %s\n' target runs cov corpus result
for t in "${targets[@]}"; do
  bin="$build/bin/${t}_fuzz"
  seeds="$root/tests/fuzz/corpus/$t"
  corpus="$build/corpus/$t"
  crashes="$root/tests/fuzz/crashes/$t"
  log="$build/fuzz-logs/$t.log"
  mkdir -p "$seeds" "$corpus" "$crashes"
  if [[ "$t" == dataset && -z "$(ls -A "$seeds")" ]]; then
    SLIDEDP_FUZZ_WRITE_SEEDS="$seeds" "$bin" -runs=0 >/dev/null 2>&1 || true
  fi
  # Replay the reproducers of earlier findings: a crash that is still there is reported as such
  # (and not fuzzed past, since libFuzzer stops at the first crash).
  : >"$log"
  replay_failed=()
  for f in "$crashes"/*; do
    [[ -f "$f" ]] || continue
    "$bin" "$f" >>"$log" 2>&1 || replay_failed+=("$(basename "$f")")
  done
  if [[ ${#replay_failed[@]} -gt 0 ]]; then
    printf '%-12s %10s %8s %8s %s\n' "$t" - - - "STILL FAILS: ${replay_failed[*]} (see $log)"
    found=1
    continue
  fi
  before=$(find "$crashes" -type f | wc -l)
  set +e
  "$bin" "$corpus" "$seeds" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2560 -max_len=8192 \
    -artifact_prefix="$crashes/" -print_final_stats=1 >>"$log" 2>&1
  rc=$?
  set -e
  after=$(find "$crashes" -type f | wc -l)
  # Keep the working corpus coverage-minimal so it does not grow without bound across runs.
  tmp="$(mktemp -d)"
  if "$bin" -merge=1 "$tmp" "$corpus" >>"$log" 2>&1; then
    rm -rf "$corpus" && mv "$tmp" "$corpus"
  else
    rm -rf "$tmp"
  fi
  if [[ $save_corpus -eq 1 ]]; then
    "$bin" -merge=1 "$seeds" "$corpus" >>"$log" 2>&1 || true
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*')
  result=ok
  if [[ $rc -ne 0 || $after -gt $before ]]; then
    result="FOUND (rc $rc; see $log and $crashes)"
    found=1
  fi
  printf '%-12s %10s %8s %8s %s\n' "$t" "${runs:-?}" "${cov:-?}" "$(find "$corpus" -type f | wc -l)" "$result"
done
exit $found
