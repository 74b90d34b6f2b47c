// arrive.hpp: the arrival count of the split merge (decode.cuh, finish_group), written once for the device
// and the host. The device calls it with atomicCAS / atomicAdd on the group's counter word in the workspace;
// tests/core/test_arrive.cpp runs the same code on host threads with std::atomic, so that CI checks the
// protocol under concurrency on any machine.
//
// The word holds the launch's epoch (a host counter, never 0) in its high half and the number of the group's
// CTAs counted in so far in its low half. A word whose high half is another epoch (left by another launch, or
// never written: the workspace may hold any bytes) counts as zero; only bytes whose high half happens to equal the
// launch's epoch (2^-32 for random bytes) would be miscounted. The group's last CTA resets the word to 0
// after its merge, so that the next launch, or a replay of the same captured graph with the same epoch,
// finds the reset state.
//
// The first compare-and-swap guesses the reset state: the first CTA of a launch costs one round trip. A CTA
// that finds the word already tagged with its launch's epoch counts itself in with one add. Only a word of
// another epoch is replaced by compare-and-swap, and only one CTA can do that: once the word carries this
// launch's tag it changes only by this launch's adds until its last CTA resets it. (Every CTA once retried
// its compare-and-swap until no other CTA had moved the word in between: with 16 CTAs arriving within ~1 us,
// the group's last one waited ~8 us in that loop; bench/results/decode-gqa-ab-2026-12-01b.md.)
#pragma once

#if defined(__CUDACC__)
#define KVQ_ARRIVE_HD __host__ __device__
#else
#define KVQ_ARRIVE_HD
#endif

namespace kvq::cuda::detail {

// Ops: cas(expected, desired) and add(v), each atomic on the one 64-bit counter word and returning the word's
// previous value. Returns true for the CTA that brings the count to n (the group's last).
template <class Ops>
KVQ_ARRIVE_HD inline bool arrive_last_on(Ops& ops, unsigned epoch, int n) {
  const unsigned long long tag = static_cast<unsigned long long>(epoch) << 32;
  unsigned long long cur = ops.cas(0ull, tag + 1);
  if (cur == 0) return n == 1;
  for (;;) {
    if ((cur >> 32) == epoch) return static_cast<int>((ops.add(1ull) & 0xffffffffull) + 1) == n;
    const unsigned long long prev = ops.cas(cur, tag + 1);  // a stale or foreign word: this CTA is the first
    if (prev == cur) return n == 1;
    cur = prev;
  }
}

}  // namespace kvq::cuda::detail
