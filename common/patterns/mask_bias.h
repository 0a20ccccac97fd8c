// An attention mask's finite bias in the raw score units the engines add it in.
#pragma once

#include <limits>

namespace attnbench {

/// The largest magnitude of a finite mask bias in raw score units: FLT_MAX / 4.
inline constexpr float kMaskRawLimit = std::numeric_limits<float>::max() / 4;

/// An attention mask's finite bias x in raw score units: x * root (root = 1 / the softmax
/// scale, sqrt(d) for the scaled dot product), kept finite. torch.finfo(torch.float32).min,
/// the value Hugging Face models put in their masks, times sqrt(d) overflows to -inf; a bias
/// whose raw value would pass -kMaskRawLimit (or +kMaskRawLimit) is that limit instead. Such
/// a key gets weight 0 beside any key of an ordinary logit, and a row of such keys only is
/// the uniform average of their values, as in the float64 reference and torch: the scores the
/// limit is added to stay finite, and so do their differences from the row max. (Two biases
/// both past the limit count as equal: a row mixing -FLT_MAX and -FLT_MAX / 10 averages both
/// where the reference keeps only the latter.)
inline float mask_bias_raw(float x, float root) {
  const float r = x * root;
  return r < -kMaskRawLimit ? -kMaskRawLimit : (r > kMaskRawLimit ? kMaskRawLimit : r);
}

}  // namespace attnbench
