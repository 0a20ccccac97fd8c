#include "common/core/tensor.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common/core/checked.h"
#include "common/core/error.h"

namespace attnbench {

void Tensor::Free::operator()(float* p) const { std::free(p); }

Tensor::Tensor(Shape4 s, int64_t group) : shape_(s), group_(group) {
  if (group < 1)
    throw InputError(
        fmt::format("tensor group {}: accepted: at least 1 head per stored head", group));
  // The element count and byte size are formed with overflow checks: a shape whose product
  // wraps around must not become a small buffer that kernels then walk off.
  int64_t count = 1;
  for (int64_t e : {s.batch, s.heads, s.len, s.dim})
    if ((count = checked_mul(count, e)) < 0)
      throw InputError(
          fmt::format("tensor shape {} has a negative extent or more elements than "
                      "fit in 64 bits",
                      s.str()));
  const int64_t bytes = checked_mul(count, int64_t(sizeof(float)));
  if (bytes < 0 || bytes > INT64_MAX - 63)
    throw InputError(fmt::format("tensor shape {} needs more bytes than fit in 64 bits", s.str()));
  size_t rounded = (size_t(bytes) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded ? rounded : 64);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  data_.reset(static_cast<float*>(p));
}

}  // namespace attnbench
