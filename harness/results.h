// Result files of a sweep: results.csv (tidy, one row per variant x problem, appended and
// flushed as each row finishes), benchmark.json (Google Benchmark's JSON, all runs) and
// meta.json (how and where the run was made).
#pragma once

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "harness/output_dir.h"
#include "harness/runner.h"

namespace attnbench {

/// The results.csv columns, in order.
const std::vector<std::string>& csv_columns();
/// A CSV field, quoted (RFC 4180) if it holds a comma, quote or line break.
std::string csv_quote(const std::string& s);
/// One CSV line (no newline) for a row, fields quoted where needed.
std::string csv_line(const Row& row);
/// Splits one CSV line into fields (RFC 4180 quoting).
std::vector<std::string> split_csv_line(const std::string& line);
/// The results.csv columns that identify a row's configuration: spec and every problem field.
const std::vector<std::string>& key_columns();
/// Line f of a file whose header is an older layout of `columns` (columns added since are
/// missing: key_padding and attn_mask, input_layer and input_source, ...), with those columns
/// filled as an older row means them (empty: no padding, no mask, no layer; input_source "file"
/// for input "file", else "generated"); nothing if the header is not an older layout of
/// `columns`.
std::optional<std::vector<std::string>> upgrade_line(const std::vector<std::string>& header,
                                                     const std::vector<std::string>& f,
                                                     const std::vector<std::string>& columns);
/// The values of key_columns() for a row, as results.csv writes them.
std::vector<std::string> key_fields(const Row& row);
/// Key identifying a row's configuration: spec and every problem field.
std::string row_key(const Row& row);

/// Writes `j` to `path` (indented) with write_file_atomic: an interrupted run or a full disk
/// never leaves a torn file (WriteError, the previous file intact).
void write_json_file(const std::string& path, const nlohmann::json& j);

/// Why a results.csv line (split, with `header` the current columns) cannot stand for a
/// finished row: a field count, key field, status or number that attnbench never writes
/// (numbers must be finite; times, sizes and counts non-negative; an ok row's times positive).
/// "" if it can.
std::string malformed_reason(const std::vector<std::string>& header,
                             const std::vector<std::string>& f);

class ResultsDir {
 public:
  /// Opens DIR (creating it) and holds its lock (claim_results_dir) until destroyed. With
  /// resume, rows already in DIR/results.csv are kept and reported by done(); without it, a
  /// DIR holding results is refused, or with `force` its results are moved aside first.
  ResultsDir(const std::string& dir, bool resume, bool force = false);
  ~ResultsDir();
  ResultsDir(const ResultsDir&) = delete;
  ResultsDir& operator=(const ResultsDir&) = delete;

  bool done(const Row& row) const { return done_.count(row_key(row)) > 0; }
  /// Status of a finished row (kept or appended); "" if the row is not done.
  std::string status(const Row& row) const;
  /// The rows results.csv holds: those kept from earlier runs and those appended since.
  size_t rows_kept() const { return done_.size(); }
  /// Appends a row to results.csv (synced to the disk at once) and its runs to benchmark.json
  /// (rewritten whole). A failed write throws WriteError: results.csv keeps every earlier row
  /// and benchmark.json its previous contents, so --resume after freeing space loses nothing.
  void append(const Row& row, const nlohmann::json& bench);
  void write_meta(const nlohmann::json& meta) const;
  /// Rewrites DIR/meta.json as `meta` (this run's record, written by write_meta at its start
  /// and completed at its end), keeping the earlier runs write_meta carried over.
  void update_meta(const nlohmann::json& meta) const;
  const std::string& dir() const { return dir_; }

 private:
  void write_benchmark_json() const;

  DirLock lock_;  // first: taken before anything in DIR is read or written
  std::string dir_;
  int csv_ = -1;                             // results.csv, open for appending
  std::map<std::string, std::string> done_;  // row_key -> status
  nlohmann::json bench_;                     // {"context": ..., "benchmarks": [...]}
};

}  // namespace attnbench
