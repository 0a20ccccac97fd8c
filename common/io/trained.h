// Trained inputs: q, k, v a small trained causal language model computed on held-out text
// (input `trained`, `trained:layer=L`), read from the attnbench cache.
//
// Layout, under cache_root():
//   trained/qkv/meta.json    {"format": 1, "layers": 4, "heads": 8, "dim": 64, "context": 1024,
//                             "length": 4096, "checkpoint": "<sha256 hex>", "corpus": ..., ...}
//   trained/qkv/layer{L}.npz float32 q, k, v of shape [1, heads, length, dim] (after the rotary
//                            positions, before the softmax) for L = 0 .. layers - 1
// A problem of n tokens takes the first n positions of its layer's arrays: the model is
// causal, so that prefix is exactly what a run of n tokens computes. Positions at or beyond
// `context` are beyond what the model was trained on.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/core/problem.h"
#include "common/io/inputs.h"

namespace attnbench {

/// The attnbench cache: $ATTNBENCH_CACHE if set and non-empty, else $XDG_CACHE_HOME/attnbench
/// if that is set and non-empty, else $HOME/.cache/attnbench. Throws UsageError when none of
/// them is set.
std::string cache_root();
/// The directory of the trained inputs: cache_root()/trained/qkv.
std::string trained_dir();

/// The trained inputs' meta.json.
struct TrainedMeta {
  std::string dir;  ///< the directory it was read from
  int64_t format = 0, layers = 0, heads = 0, dim = 0, context = 0, length = 0;
  std::string checkpoint;  ///< sha256 (hex) of the model's checkpoint file
  std::string json;        ///< the file's whole text (extra keys included)
};

/// Whether `input` names trained inputs: "trained" or "trained:..." (well formed or not).
bool is_trained_input(const std::string& input);
/// The layer of a trained input name ("trained" is layer 0); nothing for any other name or a
/// malformed one (never throws).
std::optional<int64_t> trained_layer(const std::string& input);
/// The canonical form of a trained input name, "trained:layer=L". Throws UsageError for an
/// unknown option key or a layer that is not a non-negative integer, naming what is accepted.
/// Does not read the cache (the layer's range is checked against it by check_trained_fits).
std::string canonical_trained_input(const std::string& input);

/// Reads trained_dir()/meta.json. Throws UsageError when it is missing (naming the scripts that
/// build it) or malformed.
TrainedMeta read_trained_meta();

/// Checks that the trained input `input` fits problem p, and that its layer's file is there
/// and well formed (read once per process and kept, see load_trained_inputs): batch 1, heads
/// and dim those of the model, m = n, kv_heads 0 or the heads, n at most the captured length,
/// the layer in range. With `head` >= 0 only that head is needed: p's batch and heads are then
/// not checked, the head must be one of the model's. Throws UsageError naming what was expected
/// and what was given. Returns the meta.
TrainedMeta check_trained_fits(const Problem& p, const std::string& input, int64_t head = -1);

/// q, k, v of p from the trained input `input` (unscaled): the first n positions of its layer's
/// arrays, k and v stored with p's key/value heads. With `head` >= 0, that head alone, as
/// [1, 1, n, d] tensors. The arrays of a layer file are kept per process (keyed by the file's
/// path, size and modification time), so a sweep reads each once. Throws UsageError as
/// check_trained_fits does, and for a file that is not a well-formed .npz of finite float32
/// arrays of the meta's shape.
Inputs load_trained_inputs(const Problem& p, const std::string& input, int64_t head = -1);

/// The results' input_source of a canonical input name: "file" for an inputs file, "generated"
/// for a generated distribution, "trained@<first 12 hex of the checkpoint>" for trained inputs
/// (reads the meta; throws UsageError as read_trained_meta does).
std::string input_source(const std::string& input);
/// The note of a row of trained input `input` whose n is beyond the model's training context
/// ("beyond the trained context (C = 1024)"); "" otherwise.
std::string trained_context_note(const Problem& p, const std::string& input);

}  // namespace attnbench
