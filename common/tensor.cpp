#include "common/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace attnbench {

void Tensor::Free::operator()(float* p) const { std::free(p); }

Tensor::Tensor(Shape4 s) : shape_(s) {
  size_t bytes = size_t(s.numel()) * sizeof(float);
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded ? rounded : 64);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  data_.reset(static_cast<float*>(p));
}

}  // namespace attnbench
