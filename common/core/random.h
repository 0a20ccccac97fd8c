// Counter-based random numbers: value i of stream s under seed is a pure function of
// (seed, s, i), so generation can be split across threads and still give the same numbers.
#pragma once

#include <cmath>
#include <cstdint>

namespace attnbench {

/// splitmix64 finaliser: a well-mixed 64-bit hash.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// One named stream of random numbers derived from a seed.
class RandomStream {
 public:
  RandomStream(uint64_t seed, uint64_t stream) : key_(mix64(seed ^ mix64(stream + 0x5851f42d))) {}
  uint64_t bits(uint64_t i) const { return mix64(key_ ^ mix64(i)); }
  /// Uniform in (0, 1).
  double uniform(uint64_t i) const { return (double(bits(i) >> 11) + 0.5) * 0x1.0p-53; }
  /// Standard normal (Box-Muller on two uniforms).
  double normal(uint64_t i) const {
    double u1 = uniform(2 * i), u2 = uniform(2 * i + 1);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  /// Integer in [0, n).
  uint64_t below(uint64_t i, uint64_t n) const { return uint64_t(uniform(i) * double(n)) % n; }

 private:
  uint64_t key_;
};

}  // namespace attnbench
