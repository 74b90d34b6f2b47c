# shellcheck shell=bash
# Shell functions of the GPU-host scripts (scripts/gpu-test, gpu-timestamps, gpu-ab); sourced, not run.

# kvq_gpu_configure SRC BUILD [cmake options...]: configures SRC into BUILD the way every GPU-host script
# builds: Release, the CUDA kernels for sm_90a, KVQ_CPU_DEPS=OFF (no Debian -dev packages there: the
# header-only libraries come from .deps/include).
kvq_gpu_configure() {
  local src=$1 build=$2
  shift 2
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DKVQ_CPU_DEPS=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90a "$@"
}

# kvq_copy_tree ROOT DEST: the files of ROOT that git tracks or would track (untracked ones that are not
# ignored too: a new source file before its commit, or a checkout whose index lags its files, as on a GPU
# host; the whole tree without its build dirs outside a git checkout), and its .deps, into the existing
# directory DEST. tar keeps the files' times, so a build of an earlier copy recompiles only what changed.
kvq_copy_tree() {
  local root=$1 dest=$2
  if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$root" && git ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done | tar --null -cf - -T -) |
      tar -xf - -C "$dest"
  else
    (cd "$root" && tar --exclude='./build*' -cf - .) | tar -xf - -C "$dest"
  fi
  if [ -d "$root/.deps" ]; then cp -r "$root/.deps" "$dest/"; fi
}

# kvq_tree_commit ROOT: the commit a result names when KVQ_COMMIT does not: ROOT's HEAD (12 hex digits), with
# "-dirty" appended where a tracked file differs from it, or "unknown" outside a git checkout. A GPU host's copy of a
# working tree can carry an older .git than its files (grid m of 2026-12-06 named fcb4ae3 for a tree of e697774): the
# mark says so instead of naming the older commit alone.
kvq_tree_commit() {
  local root=$1 h
  h=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null) || { echo unknown; return 0; }
  if ! git -C "$root" diff --quiet HEAD -- 2>/dev/null; then h="$h-dirty"; fi
  echo "$h"
}

# kvq_arena_pads WHAT P...: the arena pads P (MiB, `kvq bench decode --arena-pad`) in decimal in the array
# kvq_pads, without leading zeros, so that "016" and "16" name one run directory (pad16) and count as a repeated
# pad (kvq and peers.py both read 016 as 16; kvq read it as octal 14 before its integer options were made decimal).
# Returns 1 with a message naming WHAT (the variable or option that gave them) for one that is not a whole number.
kvq_arena_pads() {
  local what=$1 p
  shift
  kvq_pads=()
  for p in "$@"; do
    [[ "$p" =~ ^[0-9]{1,9}$ ]] || { echo "error: $what holds '$p', not a whole number of MiB" >&2; return 1; }
    kvq_pads+=("$(( 10#$p ))")
  done
}

# kvq_ab_order ROUND: the order in which scripts/gpu-ab runs its two builds in round ROUND (1-based): "a b" in odd
# rounds, "b a" in even ones, so that an effect of the position within a round (clocks, a drift over the call) falls
# on A and B alike over an even number of rounds instead of always on the same side.
kvq_ab_order() {
  if [ $(( $1 % 2 )) = 1 ]; then echo "a b"; else echo "b a"; fi
}

# kvq_monitor_start FILE: samples the benchmarked GPU's clocks, power, temperature and clock-event reasons every
# 50 ms into FILE (CSV for bench/gpu/monitor.py) in the background, until kvq_monitor_stop; nothing where
# nvidia-smi is missing. The GPU is CUDA's device 0: the first entry of CUDA_VISIBLE_DEVICES (an index or a GPU
# UUID, both of which nvidia-smi -i takes; on hosts of identical GPUs CUDA's default order is nvidia-smi's), else 0.
# Drivers that do not know clocks_event_reasons get its older name, clocks_throttle_reasons.
kvq_monitor_pid=""
kvq_monitor_start() {
  local file=$1 q gpu
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  q=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu
  if nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv,noheader >/dev/null 2>&1; then
    q=$q,clocks_event_reasons.active
  else
    q=$q,clocks_throttle_reasons.active
  fi
  gpu="${CUDA_VISIBLE_DEVICES:-0}"
  gpu="${gpu%%,*}"
  case "$gpu" in GPU-*) ;; '' | *[!0-9]*) gpu=0 ;; esac
  nvidia-smi -i "$gpu" --query-gpu="$q" --format=csv,noheader,nounits -lms 50 > "$file" 2>/dev/null &
  kvq_monitor_pid=$!
}
kvq_monitor_stop() {
  if [ -n "$kvq_monitor_pid" ]; then
    kill "$kvq_monitor_pid" 2>/dev/null || true
    wait "$kvq_monitor_pid" 2>/dev/null || true
    kvq_monitor_pid=""
  fi
}
