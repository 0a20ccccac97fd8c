#include "harness/results.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

#include "common/core/error.h"

namespace fs = std::filesystem;

namespace attnbench {

namespace {

std::string field_text(const nlohmann::ordered_json& v) {
  if (v.is_null()) return "";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "1" : "0";
  if (v.is_number_float()) return fmt::format("{}", v.get<double>());
  return v.dump();
}

const std::vector<std::string> kKeyColumns = {
    "spec",    "batch",       "heads",     "kv_heads",     "n",     "m",     "dim",
    "embed",   "causal",      "score",     "score_hidden", "input", "scale", "seed",
    "threads", "key_padding", "attn_mask", "pass",         "dtype"};

// Columns results.csv (and patterns/index.csv) gained after their first version, with the
// field a row of an older file stands for (what the row meant before the column existed;
// "=NAME": the row's own NAME field; "@source": the source of the row's input, "file" for an
// inputs file and "generated" for the rest, as no older row had trained inputs): resuming such
// a file rewrites its lines with the current columns (upgrade_line).
const std::map<std::string, std::string> kAddedColumns = {{"embed", "0"},
                                                          {"kv_heads", "=heads"},
                                                          {"attention_share", ""},
                                                          {"score", "scaled_dot"},
                                                          {"score_hidden", "0"},
                                                          {"key_padding", ""},
                                                          {"attn_mask", ""},
                                                          {"time_spread", ""},
                                                          {"load_avg", ""},
                                                          {"other_load", ""},
                                                          {"noisy", ""},
                                                          {"uniform_error", ""},
                                                          {"prepare_s", ""},
                                                          {"pass", "fwd"},
                                                          {"dtype", "f32"},
                                                          {"rounded_input_error", ""},
                                                          {"saved_bytes", ""},
                                                          {"saved_estimate_bytes", ""},
                                                          {"grad_rel_err_q", ""},
                                                          {"grad_rel_err_k", ""},
                                                          {"grad_rel_err_v", ""},
                                                          {"grad_heads", ""},
                                                          {"prefill_s", ""},
                                                          {"time_per_token_s", ""},
                                                          {"tokens_per_s", ""},
                                                          {"state_bytes", ""},
                                                          {"bytes_read_per_step", ""},
                                                          {"bandwidth_fraction", ""},
                                                          {"input_layer", ""},
                                                          {"input_source", "@source"},
                                                          {"host", ""},
                                                          {"stand_ins", ""}};

std::string join_key(const std::vector<std::string>& fields) {
  std::string k;
  for (const auto& f : fields) k += f + '\x1f';
  return k;
}

// The results.csv columns that hold numbers (or flags): those a default row does not write as
// text.
const std::set<std::string>& numeric_columns() {
  static const std::set<std::string> cols = [] {
    std::set<std::string> c;
    const auto row = to_json(Row{});  // named: items() refers to it
    for (const auto& [key, value] : row.items())
      if (!value.is_string()) c.insert(key);
    return c;
  }();
  return cols;
}

// Numeric columns that cannot be negative: times, sizes, counts, rates and errors.
bool non_negative(const std::string& c) {
  auto ends = [&](std::string_view suffix) {
    return c.size() >= suffix.size() &&
           c.compare(c.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (c == "mean_cosine" || c == "other_load") return false;
  return c.rfind("time_", 0) == 0 || ends("_s") || ends("_bytes") || ends("flops") ||
         ends("_error") || c.rfind("grad_", 0) == 0 || c.rfind("error_rows", 0) == 0 ||
         c == "reps" || c == "iterations" || c == "load_avg" || c == "tokens_per_s" ||
         c == "gemm_fraction" || c == "bandwidth_fraction";
}

// Throws UsageError if `path` exists but is not a regular file (a directory, say).
void require_regular_file(const fs::path& path) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!ec && fs::exists(st) && !fs::is_regular_file(st))
    throw UsageError(
        fmt::format("'{}' is not a regular file (a directory?); a results directory "
                    "holds results.csv, benchmark.json and meta.json as files",
                    path.string()));
}

}  // namespace

std::string malformed_reason(const std::vector<std::string>& header,
                             const std::vector<std::string>& f) {
  if (f.size() != header.size())
    return fmt::format("{} fields where the header has {}", f.size(), header.size());
  auto at = [&](const std::string& col) -> const std::string& {
    return f[size_t(std::find(header.begin(), header.end(), col) - header.begin())];
  };
  auto integer = [](const std::string& t, int64_t lo) {
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    return ec == std::errc() && ptr == t.data() + t.size() && !t.empty() && v >= lo;
  };
  auto number = [](const std::string& t) {
    if (t.empty()) return false;
    char* end = nullptr;
    const double v = std::strtod(t.c_str(), &end);
    return end == t.c_str() + t.size() && std::isfinite(v);
  };
  if (at("spec").empty()) return "empty spec";
  for (const char* c : {"batch", "heads", "kv_heads", "n", "m", "dim"})
    if (!integer(at(c), 1)) return fmt::format("{} is '{}', not a positive integer", c, at(c));
  for (const char* c : {"seed", "threads", "embed"})
    if (!integer(at(c), 0)) return fmt::format("{} is '{}', not an integer", c, at(c));
  if (at("causal") != "0" && at("causal") != "1")
    return fmt::format("causal is '{}', not 0 or 1", at("causal"));
  if (!number(at("scale"))) return fmt::format("scale is '{}', not a number", at("scale"));
  try {
    parse_score(at("score"));
  } catch (const UsageError&) {
    return fmt::format("score is '{}', not a scoring function", at("score"));
  }
  try {
    parse_dtype(at("dtype"));
  } catch (const UsageError&) {
    return fmt::format("dtype is '{}', not f32 or bf16", at("dtype"));
  }
  if (!integer(at("score_hidden"), 0))
    return fmt::format("score_hidden is '{}', not an integer", at("score_hidden"));
  const std::string& status = at("status");
  if (status != "ok" && status != "skipped" && status != "unsupported" && status != "error")
    return fmt::format("status is '{}', not ok, skipped, unsupported or error", status);
  // every other number attnbench writes is finite (a non-finite value is written empty), and
  // those that count or measure something are non-negative
  for (size_t i = 0; i < header.size(); ++i) {
    if (!numeric_columns().count(header[i]) || f[i].empty()) continue;
    if (!number(f[i])) return fmt::format("{} is '{}', not a finite number", header[i], f[i]);
    if (non_negative(header[i]) && std::strtod(f[i].c_str(), nullptr) < 0)
      return fmt::format("{} is '{}', a negative {}", header[i], f[i],
                         header[i].find("time") != std::string::npos ? "time" : "amount");
  }
  if (status == "ok")
    for (const char* c : {"time_median_s", "time_min_s", "time_max_s"})
      if (!number(at(c)) || std::strtod(at(c).c_str(), nullptr) <= 0)
        return fmt::format("an ok row whose {} is '{}', not a positive time", c, at(c));
  return "";
}

std::string csv_quote(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

const std::vector<std::string>& csv_columns() {
  static const std::vector<std::string> cols = [] {
    std::vector<std::string> c;
    const auto row = to_json(Row{});
    for (const auto& [key, value] : row.items()) c.push_back(key);
    return c;
  }();
  return cols;
}

std::string csv_line(const Row& row) {
  std::string line;
  bool first = true;
  const auto fields = to_json(row);
  for (const auto& [key, value] : fields.items()) {
    if (!first) line += ',';
    first = false;
    line += csv_quote(field_text(value));
  }
  return line;
}

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"')
        out.back() += '"', ++i;
      else if (c == '"')
        quoted = false;
      else
        out.back() += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.emplace_back();
    } else if (c != '\r') {
      out.back() += c;
    }
  }
  return out;
}

const std::vector<std::string>& key_columns() { return kKeyColumns; }

std::optional<std::vector<std::string>> upgrade_line(const std::vector<std::string>& header,
                                                     const std::vector<std::string>& f,
                                                     const std::vector<std::string>& columns) {
  std::vector<std::string> out;
  for (const auto& c : columns) {
    const auto it = std::find(header.begin(), header.end(), c);
    if (it != header.end()) {
      const size_t i = size_t(it - header.begin());
      out.push_back(i < f.size() ? f[i] : std::string());
      continue;
    }
    const auto added = kAddedColumns.find(c);
    if (added == kAddedColumns.end()) return std::nullopt;
    if (added->second == "@source") {
      const auto src = std::find(header.begin(), header.end(), "input");
      if (src == header.end()) return std::nullopt;
      const size_t i = size_t(src - header.begin());
      out.push_back(i < f.size() && f[i] == "file" ? "file" : "generated");
      continue;
    }
    if (added->second.starts_with('=')) {
      const auto src = std::find(header.begin(), header.end(), added->second.substr(1));
      if (src == header.end()) return std::nullopt;
      const size_t i = size_t(src - header.begin());
      out.push_back(i < f.size() ? f[i] : std::string());
      continue;
    }
    out.push_back(added->second);
  }
  for (const auto& c : header)
    if (std::find(columns.begin(), columns.end(), c) == columns.end()) return std::nullopt;
  return out;
}

std::vector<std::string> key_fields(const Row& row) {
  auto j = to_json(row);
  std::vector<std::string> f;
  for (const auto& c : kKeyColumns) f.push_back(field_text(j[c]));
  return f;
}

std::string row_key(const Row& row) { return join_key(key_fields(row)); }

std::string ResultsDir::status(const Row& row) const {
  auto it = done_.find(row_key(row));
  return it == done_.end() ? std::string() : it->second;
}

namespace {

void drop_torn_line(const fs::path& csv_path) {
  // A line without its newline was torn by an interrupted write: drop it so the next row
  // starts on a line of its own (that configuration simply runs again).
  std::string text;
  {
    std::ifstream in(csv_path, std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (!text.empty() && text.back() != '\n') {
    const size_t keep = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
    std::error_code ec;
    fs::resize_file(csv_path, keep, ec);
    if (ec)
      throw WriteError(fmt::format("cannot cut the torn last line off '{}': {}", csv_path.string(),
                                   ec.message()));
    fmt::print(stderr,
               "attnbench: warning: {} ended in a torn line (an interrupted write); it is "
               "dropped and its configuration runs again\n",
               csv_path.string());
  }
}

// The benchmark.json of a resumed sweep: its Google Benchmark records; one that is not Google
// Benchmark JSON is moved aside and null returned (a new one is started).
nlohmann::json resumed_benchmarks(const fs::path& json_path, const std::string& dir) {
  std::ifstream j(json_path);
  nlohmann::json bench = nlohmann::json::parse(j, nullptr, false);
  const bool usable =
      bench.is_object() && bench.contains("benchmarks") && bench["benchmarks"].is_array();
  if (!usable) {
    // Not Google Benchmark JSON: set it aside, never lose it, and start a new one.
    fs::path aside = fs::path(dir) / "benchmark.json.unreadable";
    for (int i = 2; fs::exists(aside); ++i)
      aside = fs::path(dir) / fmt::format("benchmark.json.unreadable.{}", i);
    fmt::print(stderr,
               "attnbench: warning: {} is not Google Benchmark JSON (an object with "
               "a \"benchmarks\" array); moved to {}, a new one is started\n",
               json_path.string(), aside.string());
    fs::rename(json_path, aside);
    bench = nlohmann::json();
  } else if (!bench.contains("context")) {
    bench["context"] = nullptr;
  }
  return bench;
}

}  // namespace

ResultsDir::ResultsDir(const std::string& dir, bool resume, bool force)
    : lock_(claim_results_dir(dir, resume, force, "sweep")), dir_(dir) {
  const fs::path csv_path = fs::path(dir) / "results.csv",
                 json_path = fs::path(dir) / "benchmark.json";
  for (const char* name : {"results.csv", "benchmark.json", "meta.json", "benchmark.json.tmp"})
    require_regular_file(fs::path(dir) / name);
  bool have_header = false;
  if (resume && fs::exists(csv_path)) drop_torn_line(csv_path);
  if (resume && fs::exists(csv_path) && fs::file_size(csv_path) > 0) {
    std::ifstream in(csv_path);
    std::string line;
    std::getline(in, line);
    auto header = split_csv_line(line);
    // an older layout (columns added since): every line is rewritten with the current ones
    const bool upgrade =
        header != csv_columns() && upgrade_line(header, header, csv_columns()).has_value();
    const std::vector<std::string> old_header = header;
    if (upgrade) header = csv_columns();
    if (header != csv_columns())
      throw UsageError(
          fmt::format("cannot resume: '{}' has different columns than this version of "
                      "attnbench writes; use a new --out directory",
                      csv_path.string()));
    have_header = true;
    std::vector<size_t> idx;
    for (const auto& c : kKeyColumns)
      idx.push_back(size_t(std::find(header.begin(), header.end(), c) - header.begin()));
    const size_t status_idx =
        size_t(std::find(header.begin(), header.end(), "status") - header.begin());
    // A complete line that cannot stand for a finished row (hand-edited, or written by
    // something else) is reported, moved to results.malformed.csv and its configuration runs
    // again; every other line is kept as it is.
    std::string kept, rejected;
    for (const auto& c : header) kept += (kept.empty() ? "" : ",") + c;
    kept += '\n';
    int64_t line_no = 1, n_rejected = 0;
    while (std::getline(in, line)) {
      ++line_no;
      if (line.empty()) continue;
      auto f = split_csv_line(line);
      if (upgrade && f.size() == old_header.size()) {
        f = *upgrade_line(old_header, f, csv_columns());
        line.clear();
        for (size_t i = 0; i < f.size(); ++i) line += (i ? "," : "") + csv_quote(f[i]);
      }
      if (std::string why = malformed_reason(header, f); !why.empty()) {
        fmt::print(stderr,
                   "attnbench: warning: {} line {} is malformed ({}); it is moved to "
                   "results.malformed.csv and its configuration runs again\n",
                   csv_path.string(), line_no, why);
        rejected += line + '\n';
        ++n_rejected;
        continue;
      }
      kept += line + '\n';
      std::vector<std::string> key;
      for (size_t i : idx) key.push_back(f[i]);
      done_[join_key(key)] = f[status_idx];
    }
    in.close();
    if (n_rejected > 0 || upgrade) {
      if (n_rejected > 0) {
        // kept whole: what an earlier file held comes before the lines set aside now
        const fs::path bad = fs::path(dir) / "results.malformed.csv";
        std::string earlier;
        if (fs::exists(bad)) {
          std::ifstream b(bad, std::ios::binary);
          earlier.assign(std::istreambuf_iterator<char>(b), std::istreambuf_iterator<char>());
        }
        write_file_atomic(bad.string(), earlier + rejected);
      }
      write_file_atomic(csv_path.string(), kept);
    }
    if (fs::exists(json_path)) bench_ = resumed_benchmarks(json_path, dir);
  }
  // Without rows to keep (claim_results_dir made sure of that, or moved them aside), the file
  // starts anew with its header.
  csv_ =
      ::open(csv_path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (have_header ? 0 : O_TRUNC), 0644);
  if (csv_ < 0)
    throw WriteError(fmt::format("cannot write '{}': {}", csv_path.string(), std::strerror(errno)));
  if (!have_header) {
    std::string header;
    for (const auto& c : csv_columns()) header += (header.empty() ? "" : ",") + c;
    append_synced(csv_, csv_path.string(), header + '\n');
  }
  if (!bench_.is_object()) bench_ = {{"context", nullptr}, {"benchmarks", nlohmann::json::array()}};
  write_benchmark_json();
}

ResultsDir::~ResultsDir() {
  if (csv_ >= 0) ::close(csv_);
}

void ResultsDir::append(const Row& row, const nlohmann::json& bench) {
  append_synced(csv_, (fs::path(dir_) / "results.csv").string(), csv_line(row) + '\n');
  done_[row_key(row)] = row.status;
  if (bench.is_object() && bench.contains("benchmarks") && bench["benchmarks"].is_array()) {
    if (bench_["context"].is_null() && bench.contains("context"))
      bench_["context"] = bench["context"];
    for (const auto& b : bench["benchmarks"]) bench_["benchmarks"].push_back(b);
    write_benchmark_json();
  }
}

void ResultsDir::write_benchmark_json() const {
  write_file_atomic((fs::path(dir_) / "benchmark.json").string(), bench_.dump(2) + '\n');
}

void write_json_file(const std::string& path, const nlohmann::json& j) {
  write_file_atomic(path, j.dump(2) + '\n');
}

void ResultsDir::write_meta(const nlohmann::json& meta) const {
  const fs::path path = fs::path(dir_) / "meta.json";
  nlohmann::json out = meta;
  // A resumed directory holds rows of earlier sweeps too: keep their command lines and their
  // whole meta records (machine figures, commit, date), oldest first, so the directory still
  // says how, where and against which machine figures all of its rows were made.
  if (rows_kept() > 0 && fs::exists(path)) {
    std::ifstream in(path);
    auto old = nlohmann::json::parse(in, nullptr, false);
    if (old.is_object()) {
      nlohmann::json earlier = nlohmann::json::array(), runs = nlohmann::json::array();
      if (old.contains("earlier_command_lines") && old["earlier_command_lines"].is_array())
        earlier = old["earlier_command_lines"];
      if (old.contains("earlier_runs") && old["earlier_runs"].is_array())
        runs = old["earlier_runs"];
      if (old.contains("command_line")) earlier.push_back(old["command_line"]);
      old.erase("earlier_command_lines");
      old.erase("earlier_runs");
      runs.push_back(old);
      out["earlier_command_lines"] = earlier;
      out["earlier_runs"] = runs;
    } else {
      fmt::print(stderr,
                 "attnbench: warning: {} was not a JSON object; the earlier runs it "
                 "described are not carried over\n",
                 path.string());
    }
  }
  write_json_file(path, out);
}

void ResultsDir::update_meta(const nlohmann::json& meta) const {
  const fs::path path = fs::path(dir_) / "meta.json";
  nlohmann::json out = meta;
  std::ifstream in(path);
  const auto old = nlohmann::json::parse(in, nullptr, false);
  if (old.is_object())
    for (const char* key : {"earlier_command_lines", "earlier_runs"})
      if (old.contains(key)) out[key] = old[key];
  write_json_file(path, out);
}

}  // namespace attnbench
