// NumPy .npy and .npz files, so inputs can come from (and outputs go to) Python.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/core/problem.h"
#include "common/io/inputs.h"

namespace attnbench {

/// One array as stored in a .npy file (C order only).
struct NpyArray {
  std::string dtype;  ///< NumPy descr, e.g. "<f4", "|u1"
  std::vector<int64_t> shape;
  std::vector<char> data;  ///< raw little-endian bytes, C order

  /// Product of the shape; throws InputError if it overflows int64.
  int64_t numel() const;
};

/// Parses the bytes of a .npy file. `what` names the source in error messages.
NpyArray parse_npy(const std::string& bytes, const std::string& what);
/// Serialises an array to .npy (format 1.0).
std::string encode_npy(const NpyArray& a);

void write_npy(const std::string& path, const NpyArray& a);
NpyArray read_npy(const std::string& path);
/// Reads every array of an .npz archive (stored or deflated, as np.savez and
/// np.savez_compressed write them). Keys drop the ".npy" suffix. Sizes the zip declares are
/// checked against the file and the memory available before anything is allocated, and
/// every entry's CRC is checked; a bad archive throws InputError naming the file and entry.
std::map<std::string, NpyArray> read_npz(const std::string& path);
/// read_npz on an archive held in memory; `what` names it in error messages.
std::map<std::string, NpyArray> read_npz_buffer(std::string_view bytes, const std::string& what);
/// Writes an .npz archive (stored, like np.savez).
void write_npz(const std::string& path, const std::map<std::string, NpyArray>& arrays);

/// Makes a float32 array from a tensor.
NpyArray to_npy(const Tensor& t);

/// Loads q, k, v from an .npz file: float32 arrays of shape [B, H, len, d], q with n rows and
/// k, v with m rows, all finite. Fills batch, heads, n, m, dim of *p (the workload of
/// such inputs is input "file"). Throws InputError naming what is wrong.
Inputs load_inputs_npz(const std::string& path, Problem* p);
/// The checks and copies of load_inputs_npz on arrays already read; `what` names their source.
/// For the bilinear and additive scores (p->score set before the call) it also reads the
/// score weights if the file holds them (w_bilinear [H, d, d]; w_q, w_k [H, h, d], w_score
/// [H, h]) into p->score_weights, all of the score's arrays or none.
Inputs inputs_from_arrays(std::map<std::string, NpyArray> arrays, const std::string& what,
                          Problem* p);

/// Reads the attention mask of --attn-mask: a .npy file, or the array `attn_mask` of an .npz.
/// Accepted: float32 added to the logits (-inf masks a key out; NaN and +inf are refused), or
/// bool / uint8 where true (non-zero) means masked out (torch.nn.MultiheadAttention's
/// convention; F.scaled_dot_product_attention's bool mask is the opposite), of shape [n, m]
/// or [B or 1, H or 1, n, m] for problem p. Throws InputError naming what is wrong and what
/// is accepted. The mask's name is the file name without its directories.
std::shared_ptr<const AttnMask> load_attn_mask(const std::string& path, const Problem& p);
/// load_attn_mask on an array already read; `what` names its source.
std::shared_ptr<const AttnMask> attn_mask_from_array(const NpyArray& a, const std::string& what,
                                                     const Problem& p);

}  // namespace attnbench
