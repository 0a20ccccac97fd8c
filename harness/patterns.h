// Attention patterns as arrays: the export of one head (`attnbench pattern`) and the
// patterns a sweep keeps next to its results, so that figures are drawn from what was
// measured rather than from whichever binary is at hand.
//
// A sweep stores, for each variant spec and causal setting, the pattern of one measured
// problem (head 0 of batch 0) as DIR/patterns/<file>.npy, uint8 [n, m], 1 = attended, and
// lists it in DIR/patterns/index.csv with the spec and problem columns of its results.csv
// row. The problem is picked among the sweep's configurations of that spec and causal
// setting: input gaussian if the sweep has it (else the first input), then the length
// nearest kPatternLength (the shorter of two equally near), then the first such
// configuration in sweep order. Problems with more than kMaxPatternPairs pairs are not
// stored. A variant without a pattern is listed with an empty file and a message.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/core/problem.h"
#include "common/core/registry.h"
#include "common/core/workload.h"
#include "common/io/inputs.h"
#include "common/io/npy.h"
#include "common/patterns/pattern.h"

namespace attnbench {

/// Length of the stored patterns the sweep aims for (that of the pattern figure).
constexpr int64_t kPatternLength = 1024;
/// Largest n * m of a stored pattern (a 16 MiB file).
constexpr double kMaxPatternPairs = double(1 << 24);

/// The pattern `v` uses on head (0, head) of `p`, made from `given` when set, else from the
/// inputs a run of `p` under `w` gives that head (generated for that head alone and shown at every
/// head index, so a data-dependent pattern sees exactly what a run gives it). nullptr if the
/// variant has no pattern.
std::unique_ptr<SparsePattern> head_pattern(const Variant& v, const Problem& p, const Workload& w,
                                            int64_t head, const Inputs* given);

/// Head (b, h) of a pattern intersected with the causal mask, as a uint8 [n, m] array
/// (1 = query i attends key j).
NpyArray pattern_array(const Problem& p, const SparsePattern& pat, int64_t b, int64_t h);

/// File name (inside DIR/patterns) of the stored pattern of `spec` on `p`: the spec with
/// every character other than a letter, digit, '=', '.' or '-' replaced by '_' (its first
/// 120 characters), then
/// "-n<n>-m<m>-causal" or "-noncausal", then 16 hex digits of the FNV-1a hash of the
/// results.csv key of (spec, p, w), then ".npy".
std::string pattern_file_name(const std::string& spec, const Problem& p, const Workload& w);

/// Why the file at `path` is not a whole stored pattern (a uint8 [n, m] .npy): truncated,
/// unreadable or of another dtype or shape; "" if it is one.
std::string pattern_file_problem(const std::string& path);

/// DIR/patterns of a sweep and its index.csv.
class PatternStore {
 public:
  /// The index.csv columns: the results.csv key columns, then `file` and `message`.
  static const std::vector<std::string>& index_columns();

  /// Opens DIR/patterns (creating it); the caller holds DIR's lock (ResultsDir). Without resume
  /// a new index starts; with it, the entries of index.csv whose file is a whole pattern are
  /// kept (the others are stored again).
  PatternStore(const std::string& results_dir, bool resume);

  /// Declares one configuration of the sweep, in sweep order (before the first row).
  void plan(const std::string& spec, const Problem& p, const Workload& w);
  /// After the row of a configuration is finished (or kept from an earlier sweep, with its
  /// status): stores its pattern if it is the picked problem of its spec and causal
  /// setting, its status is ok and the index holds nothing for that spec and setting yet.
  /// A pattern that cannot be made or written is reported on stderr, never thrown: the
  /// row is already safe in results.csv.
  void row_done(const Variant& v, const Problem& p, const Workload& w, const std::string& status);

 private:
  struct Entry {
    std::vector<std::string> fields;  // index_columns(), in order
  };
  void pick();
  void add(const Entry& e);
  void write_index() const;

  std::string dir_;
  struct Planned {
    std::string spec;
    Problem problem;
    Workload workload;
  };
  std::vector<Planned> planned_;
  bool picked_ = false;
  std::map<std::string, std::string> chosen_;  // (spec, causal) -> results.csv key
  std::map<std::string, Entry> entries_;       // (spec, causal) -> index entry
  std::vector<std::string> order_;             // (spec, causal) in index order
};

}  // namespace attnbench
