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

# kvq_copy_tree ROOT DEST: the tracked files of ROOT (the whole tree without its build dirs outside a git
# checkout, as on the GPU host), and its .deps, into the existing directory DEST. tar keeps the files'
# times, so a build of an earlier copy recompiles only what changed.
kvq_copy_tree() {
  local root=$1 dest=$2
  if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$root" && git ls-files -z | tar --null -cf - -T -) | tar -xf - -C "$dest"
  else
    (cd "$root" && tar --exclude='./build*' -cf - .) | tar -xf - -C "$dest"
  fi
  if [ -d "$root/.deps" ]; then cp -r "$root/.deps" "$dest/"; fi
}

# kvq_ab_order ROUND: the order in which scripts/gpu-ab runs its two builds in round ROUND (1-based): "a b" in odd
# rounds, "b a" in even ones, so that an effect of the position within a round (clocks, a drift over the call) falls
# on A and B alike over an even number of rounds instead of always on the same side.
kvq_ab_order() {
  if [ $(( $1 % 2 )) = 1 ]; then echo "a b"; else echo "b a"; fi
}
