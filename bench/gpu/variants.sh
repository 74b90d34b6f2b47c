#!/usr/bin/env bash
# Same-call timing of compile-time variants of the fast GQA decode kernel (decode_d128.cu) or of the store kernels
# (FILE=store.cu), on a GPU host:
#   OUT=DIR VARIANTS="NAME=V[,NAME=V...] ..." [ROUNDS=2] [PADS="0 ..."] [FORMATS=...] [BATCH=8] [CONTEXT=16384,65536] \
#     [TESTS="..."] [FLUSH=read|write|none] [FILE=decode_d128.cu|store.cu] [STORE_TOKENS=1024] bench/gpu/variants.sh
#     ([WORK=/tmp/kvq-variants]: the scratch folder, emptied first; FLUSH: `kvq bench decode --flush`, read by
#     default, none only to tell cold-cache costs apart; STORE_TOKENS: `--store-tokens`, the store rows' tokens;
#     ARGS: more `kvq bench decode` options for every run, e.g. ARGS="--protect none,paper --gap-ms 100")
#   OUT=DIR MACRO=NAME VARIANTS="1 2 ..." ... bench/gpu/variants.sh      (each variant NAME=v)
# Builds `kvq` once from the tree (every macro at its default: variant 0) and compiles FILE (src/cuda/, default
# decode_d128.cu) again with the -D flags of each variant (the i-th of VARIANTS, i from 1), linking a `kvq` with each
# (the library's other objects unchanged: only decode_d128.cu includes decode_fast.cuh, where its macros are; store.cu
# holds the store kernels and its own). Then runs `kvq bench decode --json` with every binary, ROUNDS rounds, each
# once per pad of PADS (MiB, `--arena-pad`: the pools at another physical placement), the binaries in alternating
# order, into DIR/r<run>_k<i>.json (DIR/variants.txt: i and its flags; DIR/runs.txt: each run's round and pad), and
# tests/cuda/test_cuda_decode linked with each variant that TESTS names (as written in VARIANTS).
# Several pads matter: one binary's placement can favour a row by a few percent over another's with the same kernel
# code (bench/results/decode-gqa-early-rows-2026-12-06.md). Every macro must exist in src/cuda/decode_fast.cuh (with
# FILE=store.cu in src/cuda/store.cu), as in the probes' patches (bench/results/decode-gqa-ablate-2026-12-05.patch:
# KVQ_ABLATE; decode-gqa-pf-2026-12-05.patch: KVQ_FAST_PF; decode-gqa-probes-2026-12-05.patch: both, with
# KVQ_FAST_FILL; store-probe-2026-12-06.patch: KVQ_STORE_PROBE).
# Last it prints `bench/gpu/ab.py --variants DIR`: per row, each variant's minimum over the runs and its speed
# against variant 0, of the minima and of the medians.
# PACK=1: then the run files (r*_k*.json, runs.txt, variants.txt) go into DIR/runs.tgz and leave DIR, which then
# holds one archive instead of 2 + ROUNDS x pads x (variants + 1) files (the device tool brings back at most eight
# files of $OUT); `tar -xzf runs.tgz -C D && bench/gpu/ab.py --variants D` prints the table again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=scripts/lib/gpu.sh
. "$root/scripts/lib/gpu.sh"
out="${OUT:?set OUT}"
macro="${MACRO:-}"
read -r -a specs <<< "${VARIANTS:?set VARIANTS}"
rounds="${ROUNDS:-2}"
read -r -a pads <<< "${PADS:-0}"
kvq_arena_pads PADS "${pads[@]}" || exit 1
pads=("${kvq_pads[@]}")
formats="${FORMATS:-tq-4bit-nc,tq-k3v4-nc,tq-3bit-nc,tq-4bit,tq-3.5bit,tq-3bit}"
read -r -a tests <<< "${TESTS:-}"
flush="${FLUSH:-read}"
read -r -a args <<< "${ARGS:-}"
file="${FILE:-decode_d128.cu}"
case "$file" in
  decode_d128.cu) msrc="$root/src/cuda/decode_fast.cuh" ;;
  store.cu) msrc="$root/src/cuda/store.cu" ;;
  *) echo "error: FILE must be decode_d128.cu or store.cu, not '$file'" >&2; exit 1 ;;
esac
store_tokens="${STORE_TOKENS:-1024}"
[[ "$store_tokens" =~ ^[1-9][0-9]*$ ]] || { echo "error: STORE_TOKENS must be a positive integer, not '$store_tokens'" >&2; exit 1; }
case "$flush" in
  read | write | none) ;;
  *) echo "error: FLUSH must be read, write or none, not '$flush'" >&2; exit 1 ;;
esac
work="${WORK:-/tmp/kvq-variants}"  # scratch: the tree copy, the builds, the binaries
labels=() flags=()
for v in "${specs[@]}"; do
  if [[ "$v" == *=* ]]; then
    lab="$v"
  else
    [ -n "$macro" ] || { echo "error: variant '$v' is a value without MACRO (give MACRO, or NAME=VALUE)" >&2; exit 1; }
    lab="$macro=$v"
  fi
  f=""
  IFS=',' read -r -a defs <<< "$lab"
  for d in "${defs[@]}"; do
    name="${d%%=*}"
    if ! [[ "$d" == *=* && "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ && "${d#*=}" =~ ^-?[0-9]+$ ]]; then
      echo "error: '$d' in variant '$v' is not NAME=INTEGER" >&2
      exit 1
    fi
    grep -q "$name" "$msrc" || { echo "error: $name is not in ${msrc#"$root"/}" >&2; exit 1; }
    f+=" -D$d"
  done
  labels+=("$lab") flags+=("$f")
done
n=${#specs[@]}
tested=()
for t in "${tests[@]}"; do
  hit=""
  for i in $(seq 1 "$n"); do [ "${specs[i-1]}" = "$t" ] && hit=$i; done
  [ -n "$hit" ] || { echo "error: TESTS names '$t', which is not in VARIANTS" >&2; exit 1; }
  tested+=("$hit")
done
rm -rf "$work" && mkdir -p "$work/src" "$work/obj"
kvq_copy_tree "$root" "$work/src"
b="$work/build"
kvq_gpu_configure "$work/src" "$b" > "$work/cmake.log" 2>&1 || { tail -20 "$work/cmake.log"; exit 1; }
obj=src/cuda/CMakeFiles/kvq_cuda.dir/$file.o
cc=$(ninja -C "$b" -t commands "$obj" | tail -1)
t0=$(date +%s)
targets=(kvq)
[ ${#tested[@]} -gt 0 ] && targets+=(test_cuda_decode)
cmake --build "$b" --target "${targets[@]}" -j 8 > "$work/build.log" 2>&1 &
pb=$!
pids=()
for k in $(seq 1 "$n"); do
  mkdir -p "$work/obj/$k"
  c="${cc/-MF $obj.d/-MF $work/obj/$k/d.d}"
  c="${c/-o $obj/${flags[k-1]} -o $work/obj/$k/$file.o}"
  (cd "$b" && eval "$c") > "$work/obj/$k/log" 2>&1 &
  pids+=($!)
done
wait "$pb" || { tail -30 "$work/build.log"; exit 1; }
for p in "${pids[@]}"; do wait "$p" || { cat "$work"/obj/*/log | tail -30; exit 1; }; done
echo "builds: $(( $(date +%s) - t0 )) s"
cp "$b/tools/kvq/kvq" "$work/kvq_0"
link=$(ninja -C "$b" -t commands tools/kvq/kvq | tail -1)
tlink=""
[ ${#tested[@]} -gt 0 ] && tlink=$(ninja -C "$b" -t commands tests/cuda/test_cuda_decode | tail -1)
for k in $(seq 1 "$n"); do
  cp "$b/src/cuda/libkvq_cuda.a" "$work/obj/$k/lib.a"
  ar r "$work/obj/$k/lib.a" "$work/obj/$k/$file.o"
  l="${link//src\/cuda\/libkvq_cuda.a/$work/obj/$k/lib.a}"
  (cd "$b" && eval "${l/-o tools\/kvq\/kvq/-o $work/kvq_$k}")
  if [ -n "$tlink" ]; then
    l="${tlink//src\/cuda\/libkvq_cuda.a/$work/obj/$k/lib.a}"
    (cd "$b" && eval "${l/-o tests\/cuda\/test_cuda_decode/-o $work/test_$k}")
  fi
done
mkdir -p "$out"
printf '0\t(tree)\n' > "$out/variants.txt"
for k in $(seq 1 "$n"); do printf '%d\t%s\n' "$k" "${labels[k-1]}" >> "$out/variants.txt"; done
all="0 $(seq -s ' ' 1 "$n")"
rev=$(echo "$all" | tr ' ' '\n' | tac | tr '\n' ' ')
# A run is a (round, pad) pair, numbered from 1 in that order: the files' r<run>; runs.txt says each run's pad.
printf 'run\tround\tpad_mib\n' > "$out/runs.txt"
run=0
for r in $(seq 1 "$rounds"); do
  for pad in "${pads[@]}"; do
    run=$(( run + 1 ))
    printf '%d\t%d\t%d\n' "$run" "$r" "$pad" >> "$out/runs.txt"
    order="$all"
    [ $(( run % 2 )) = 0 ] && order="$rev"
    for k in $order; do
      "$work/kvq_$k" bench decode --formats "$formats" --batch "${BATCH:-8}" --context "${CONTEXT:-16384,65536}" \
        --reps "${REPS:-30}" --store-tokens "$store_tokens" --arena-pad "$pad" --flush "$flush" "${args[@]}" --json \
        > "$out/r${run}_k$k.json"
    done
  done
  echo "round $r: $(( $(date +%s) - t0 )) s"
done
for k in "${tested[@]}"; do
  echo "test_cuda_decode with${flags[k-1]}:"
  "$work/test_$k" 2>&1 | tail -3
done
python3 "$root/bench/gpu/ab.py" --variants "$out"
if [ "${PACK:-0}" = 1 ]; then
  (cd "$out" && tar -czf runs.tgz variants.txt runs.txt r*_k*.json && rm -f variants.txt runs.txt r*_k*.json)
  echo "packed: $out/runs.tgz"
fi
