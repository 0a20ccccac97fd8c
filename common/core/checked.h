// Overflow-checked size arithmetic, and the memory a size is checked against.
//
// Every element or byte count computed from untrusted numbers (an .npy header, a zip
// directory, the command line) goes through checked_mul: a product that wraps can pass a
// "fits in memory" or "the file is long enough" check and send a kernel off the end of a
// buffer.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

#include "common/core/error.h"

namespace attnbench {

/// a * b for non-negative a and b, or -1 if either is negative or the product exceeds
/// INT64_MAX.
inline int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return -1;
  return r;
}

/// a * b, or throws E (InputError unless told, e.g. checked_mul<UsageError>) saying that `what`
/// overflows, when either is negative or the product exceeds INT64_MAX.
template <class E = InputError>
int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  const int64_t r = checked_mul(a, b);
  if (r < 0)
    throw E(std::string(what) + " = " + std::to_string(a) + " * " + std::to_string(b) +
            (a < 0 || b < 0 ? " has a negative factor" : " overflows int64") +
            "; sizes must be non-negative and their products at most 2^63 - 1");
  return r;
}

/// Bytes of memory available to a new allocation: MemAvailable from /proc/meminfo, or 8 GiB
/// where that cannot be read.
inline int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  int64_t kb = 0;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:" && kb >= 0 && kb < (INT64_MAX >> 10)) return kb << 10;
  return int64_t(8) << 30;
}

}  // namespace attnbench
