// Tensor views and owning tensors for attention inputs and outputs.
//
// Axis order everywhere in attnbench: [B, H, len, d] = (batch, head, position, feature),
// row-major, so one head of one batch item is a contiguous len x d matrix with the feature
// axis fastest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace attnbench {

/// Shape of a [B, H, len, d] tensor.
struct Shape4 {
  int64_t batch = 0, heads = 0, len = 0, dim = 0;

  int64_t numel() const { return batch * heads * len * dim; }
  bool operator==(const Shape4&) const = default;
  std::string str() const;  ///< "[B, H, len, d]"
};

/// Non-owning view of a [B, H, len, d] float tensor with strides (in elements).
/// The feature axis must be contiguous; the other strides may be anything.
///
/// A grouped view (group > 1) shows a tensor stored with H / group heads as H heads: head h
/// is stored head h / group (the keys and values of grouped-query attention, Problem::kv_heads).
/// Every head shares its storage with the other heads of its group, so a grouped view is for
/// reading; writers need one storage head per head (group = 1).
template <class T>
struct View4 {
  T* data = nullptr;
  Shape4 shape;  ///< logical shape: shape.heads counts every head of every group
  int64_t stride_b = 0, stride_h = 0, stride_row = 0;
  int64_t group = 1;  ///< heads per stored head

  View4() = default;
  View4(T* p, Shape4 s)
      : data(p),
        shape(s),
        stride_b(s.heads * s.len * s.dim),
        stride_h(s.len * s.dim),
        stride_row(s.dim) {}
  /// A grouped view of contiguous storage [B, G, len, d] (`storage`) as [B, G group, len, d].
  View4(T* p, Shape4 storage, int64_t heads_per_stored) : View4(p, storage) {
    shape.heads = storage.heads * heads_per_stored;
    group = heads_per_stored;
  }
  /// A view of mutable data converts to a view of const data.
  template <class U>
  View4(const View4<U>& o)  // NOLINT(google-explicit-constructor)
      : data(o.data),
        shape(o.shape),
        stride_b(o.stride_b),
        stride_h(o.stride_h),
        stride_row(o.stride_row),
        group(o.group) {}

  /// The stored head that head h reads (h without grouping).
  int64_t stored_head(int64_t h) const { return group == 1 ? h : h / group; }
  /// First element of the len x d matrix of (b, h).
  T* head(int64_t b, int64_t h) const { return data + b * stride_b + stored_head(h) * stride_h; }
  /// Row i of head (b, h).
  T* row(int64_t b, int64_t h, int64_t i) const { return head(b, h) + i * stride_row; }
};

using TensorView = View4<float>;
using ConstTensorView = View4<const float>;

/// Owning [B, H, len, d] float tensor, 64-byte aligned, zero-initialised. With group > 1 it
/// stores shape() = [B, G, len, d] and view() shows it grouped as [B, G group, len, d]
/// (View4::group): how k and v of grouped-query attention are held.
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(Shape4 s, int64_t group = 1);

  /// Storage shape.
  const Shape4& shape() const { return shape_; }
  /// Heads of view() per stored head.
  int64_t group() const { return group_; }
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  int64_t numel() const { return shape_.numel(); }
  TensorView view() { return {data(), shape_, group_}; }
  ConstTensorView view() const { return {data(), shape_, group_}; }

 private:
  struct Free {
    void operator()(float* p) const;
  };
  Shape4 shape_;
  int64_t group_ = 1;
  std::unique_ptr<float[], Free> data_;
};

}  // namespace attnbench
