#include "common/bf16.h"

#include <algorithm>

namespace attnbench {

void round_to_bf16(float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_round(x[i]);
}

Tensor rounded_bf16(const Tensor& t) {
  Tensor r(t.shape(), t.group());
  if (t.numel() > 0) {
    std::copy(t.data(), t.data() + t.numel(), r.data());
    round_to_bf16(r.data(), r.numel());
  }
  return r;
}

}  // namespace attnbench
