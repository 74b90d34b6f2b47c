// The split merge's arrival count (src/cuda/arrive.hpp), run on host threads with std::atomic: the same code the
// decode kernels run with atomicCAS / atomicAdd on the workspace counter. Whatever the word held before a launch
// (the reset state, a word of another epoch, any bytes) and however the CTAs interleave, exactly one of a group's n
// CTAs must be told it is the last, and the word must be back in the reset state after it resets it.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "../../src/cuda/arrive.hpp"

namespace {

using kvq::cuda::detail::arrive_last_on;

struct HostOps {
  std::atomic<unsigned long long>* w;
  unsigned long long cas(unsigned long long expected, unsigned long long desired) {
    w->compare_exchange_strong(expected, desired);
    return expected;  // the previous value, as atomicCAS returns it
  }
  unsigned long long add(unsigned long long v) { return w->fetch_add(v); }
};

// One launch of n CTAs on the word: each thread waits for the start, counts itself in; the one told it is last
// resets the word to 0 after the others have all counted in (it is last, so they have). Returns how many were
// told they are last.
int launch(std::atomic<unsigned long long>& w, unsigned epoch, int n) {
  std::atomic<int> ready{0}, lasts{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> cta;
  for (int i = 0; i < n; ++i)
    cta.emplace_back([&] {
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      HostOps ops{&w};
      if (arrive_last_on(ops, epoch, n)) {
        lasts.fetch_add(1);
        w.store(0);
      }
    });
  while (ready.load() < n) std::this_thread::yield();
  go.store(true);
  for (auto& t : cta) t.join();
  return lasts.load();
}

TEST(Arrive, ExactlyOneLastFromAnyStartingWord) {
  std::mt19937_64 rng(11);
  const unsigned long long starts[] = {0ull,                                  // reset state
                                       (5ull << 32) | 0ull, (5ull << 32) | 3,  // another epoch's word
                                       0xffffffffffffffffull,                  // the tests' 0xff workspace
                                       0x0123456789abcdefull};
  unsigned epoch = 100;
  for (int n : {1, 2, 3, 8, 16}) {
    for (unsigned long long start : starts) {
      for (int trial = 0; trial < 40; ++trial) {
        std::atomic<unsigned long long> w{start};
        ASSERT_EQ(launch(w, epoch, n), 1) << "n " << n << " start " << std::hex << start;
        ASSERT_EQ(w.load(), 0ull);
        // The next launch (a new epoch) and a replay of the same captured graph (the same epoch) start from 0.
        ASSERT_EQ(launch(w, epoch + 1, n), 1);
        ASSERT_EQ(launch(w, epoch + 1, n), 1);
        ASSERT_EQ(w.load(), 0ull);
        epoch += 2;
      }
    }
    // Random words whose high half is not the launch's epoch.
    for (int trial = 0; trial < 40; ++trial) {
      unsigned long long start = rng();
      if ((start >> 32) == epoch) start ^= 1ull << 40;
      std::atomic<unsigned long long> w{start};
      ASSERT_EQ(launch(w, epoch, n), 1) << "n " << n << " start " << std::hex << start;
      ++epoch;
    }
  }
}

TEST(Arrive, CountsInOrderWhenSequential) {
  // One CTA at a time: the k-th arrival of n is last only at k = n, from the reset state and from a foreign word;
  // the first arrival tags the word with the epoch and count 1, each later one adds 1.
  for (unsigned long long start : {0ull, (7ull << 32) | 9ull}) {
    std::atomic<unsigned long long> w{start};
    HostOps ops{&w};
    const int n = 5;
    for (int k = 1; k <= n; ++k) {
      EXPECT_EQ(arrive_last_on(ops, 42u, n), k == n) << k;
      EXPECT_EQ(w.load(), (42ull << 32) | static_cast<unsigned long long>(k));
    }
  }
}

}  // namespace
