#include "harness/patterns.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/core/error.h"
#include "harness/output_dir.h"
#include "harness/results.h"
#include "harness/shard.h"

namespace fs = std::filesystem;

namespace attnbench {

namespace {

Row key_row(const std::string& spec, const Problem& p, const Workload& w) {
  Row r;
  r.spec = spec;
  r.problem = p;
  r.workload = w;
  return r;
}

// (spec, causal): the unit of which a directory holds one stored pattern.
std::string group_of(const std::string& spec, const std::string& causal) {
  return spec + '\x1f' + causal;
}

std::string group_of(const std::string& spec, const Problem& p) {
  return group_of(spec, p.causal ? "1" : "0");
}

// Characters of the spec kept in a pattern's file name.
constexpr size_t kMaxSpecChars = 120;

// How far n is from the pattern length, as a ratio: |log2(n / kPatternLength)|.
double distance(int64_t n) { return std::abs(std::log2(double(n) / double(kPatternLength))); }

// Column of `causal` in index.csv.
size_t causal_column() {
  const auto& cols = PatternStore::index_columns();
  return size_t(std::find(cols.begin(), cols.end(), "causal") - cols.begin());
}

}  // namespace

std::unique_ptr<SparsePattern> head_pattern(const Variant& v, const Problem& p, const Workload& w,
                                            int64_t head, const Inputs* given) {
  if (given) return v.make_pattern(p, given->q.view(), given->k.view());
  const Inputs in = generate_head_inputs(p, 0, head, w);
  ConstTensorView qv(in.q.data(), p.q_shape()), kv(in.k.data(), p.kv_shape());
  qv.stride_b = qv.stride_h = kv.stride_b = kv.stride_h = 0;
  return v.make_pattern(p, qv, kv);
}

NpyArray pattern_array(const Problem& p, const SparsePattern& pat, int64_t b, int64_t h) {
  const int64_t m = p.keys();
  NpyArray a{"|u1", {p.n, m}, {}};
  a.data.resize(size_t(p.n) * size_t(m));
  for (int64_t i = 0; i < p.n; ++i)
    pattern_row(p, pat, b, h, i, reinterpret_cast<uint8_t*>(a.data.data()) + i * m);
  return a;
}

std::string pattern_file_name(const std::string& spec, const Problem& p, const Workload& w) {
  std::string name;
  for (char c : spec) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '=' || c == '.' || c == '-';
    name += keep ? c : '_';
  }
  // A spec with a long parameter value (a list of positions) would make a name longer than
  // file systems allow; the hash still tells apart names cut alike.
  if (name.size() > kMaxSpecChars) name.resize(kMaxSpecChars);
  // FNV-1a (64 bit) of the results.csv key: two specs or problems that read alike above
  // still get different names.
  const uint64_t hash = stable_hash(row_key(key_row(spec, p, w)));
  return fmt::format("{}-n{}-m{}-{}-{:016x}.npy", name, p.n, p.keys(),
                     p.causal ? "causal" : "noncausal", hash);
}

const std::vector<std::string>& PatternStore::index_columns() {
  static const std::vector<std::string> cols = [] {
    std::vector<std::string> c = key_columns();
    c.push_back("file");
    c.push_back("message");
    return c;
  }();
  return cols;
}

std::string pattern_file_problem(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    const NpyArray a = parse_npy(bytes, path);
    if (a.dtype != "|u1" || a.shape.size() != 2)
      return fmt::format("dtype {} of {} dimensions where a pattern is |u1 [n, m]", a.dtype,
                         a.shape.size());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

PatternStore::PatternStore(const std::string& results_dir, bool resume)
    : dir_((fs::path(results_dir) / "patterns").string()) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw UsageError(fmt::format("cannot create '{}': {}", dir_, ec.message()));
  const fs::path index = fs::path(dir_) / "index.csv";
  // Without resume the directory holds no earlier results (claim_results_dir refused it or
  // moved them aside), so a new index starts; with it, the entries whose file is whole are kept.
  if (resume && fs::exists(index)) {
    std::ifstream in(index);
    std::string line;
    std::getline(in, line);
    // an index written before the mask columns: its lines are read with them empty
    const std::vector<std::string> header = split_csv_line(line);
    const bool upgrade =
        header != index_columns() && upgrade_line(header, header, index_columns()).has_value();
    if (header != index_columns() && !upgrade)
      throw UsageError(
          fmt::format("cannot resume: '{}' has different columns than this version "
                      "of attnbench writes; use a new --out directory",
                      index.string()));
    const size_t file_col = index_columns().size() - 2;
    int64_t line_no = 1;
    while (std::getline(in, line)) {
      ++line_no;
      if (line.empty()) continue;
      Entry e{split_csv_line(line)};
      if (upgrade && e.fields.size() == header.size())
        e.fields = *upgrade_line(header, e.fields, index_columns());
      if (e.fields.size() != index_columns().size()) {
        fmt::print(stderr,
                   "attnbench: warning: {} line {} has {} fields where the header has {}; "
                   "it is dropped and its pattern stored again\n",
                   index.string(), line_no, e.fields.size(), index_columns().size());
        continue;
      }
      const std::string& file = e.fields[file_col];
      if (!file.empty() && !fs::is_regular_file(fs::path(dir_) / file)) {
        fmt::print(stderr,
                   "attnbench: warning: {} line {} names {}, which does not exist; its "
                   "pattern is stored again\n",
                   index.string(), line_no, file);
        continue;
      }
      if (!file.empty()) {
        if (std::string why = pattern_file_problem((fs::path(dir_) / file).string());
            !why.empty()) {
          fmt::print(stderr,
                     "attnbench: warning: {} line {} names {}, which is not a whole pattern "
                     "({}); its pattern is stored again\n",
                     index.string(), line_no, file, why);
          continue;
        }
      }
      const std::string g = group_of(e.fields.front(), e.fields[causal_column()]);
      if (entries_.count(g)) continue;  // one pattern per spec and causal setting
      entries_[g] = e;
      order_.push_back(g);
    }
  }
  write_index();
}

void PatternStore::plan(const std::string& spec, const Problem& p, const Workload& w) {
  planned_.push_back({spec, p, w});
  picked_ = false;
}

void PatternStore::pick() {
  picked_ = true;
  chosen_.clear();
  std::map<std::string, std::vector<size_t>> groups;
  for (size_t i = 0; i < planned_.size(); ++i)
    groups[group_of(planned_[i].spec, planned_[i].problem)].push_back(i);
  for (const auto& [g, idx] : groups) {
    std::string input = planned_[idx.front()].workload.input;
    for (size_t i : idx)
      if (planned_[i].workload.input == "gaussian") input = "gaussian";
    const Planned* best = nullptr;
    for (size_t i : idx) {
      const Planned& c = planned_[i];
      const Problem& p = c.problem;
      if (c.workload.input != input || double(p.n) * double(p.keys()) > kMaxPatternPairs) continue;
      if (!best || distance(p.n) < distance(best->problem.n) ||
          (distance(p.n) == distance(best->problem.n) && p.n < best->problem.n))
        best = &c;
    }
    if (best) chosen_[g] = row_key(key_row(best->spec, best->problem, best->workload));
  }
}

void PatternStore::row_done(const Variant& v, const Problem& p, const Workload& w,
                            const std::string& status) {
  if (!picked_) pick();
  const std::string spec = v.spec(), g = group_of(spec, p);
  const Row key = key_row(spec, p, w);
  auto it = chosen_.find(g);
  if (it == chosen_.end() || it->second != row_key(key) || entries_.count(g) || status != "ok")
    return;
  try {
    Entry e{key_fields(key)};
    auto pat = head_pattern(v, p, w, 0, nullptr);
    if (pat) {
      const std::string file = pattern_file_name(spec, p, w);
      write_file_atomic((fs::path(dir_) / file).string(), encode_npy(pattern_array(p, *pat, 0, 0)));
      e.fields.insert(e.fields.end(), {file, ""});
    } else {
      e.fields.insert(e.fields.end(), {"", "no attention pattern"});
    }
    add(e);
  } catch (const WriteError&) {
    throw;  // a full disk or a failed write stops the sweep; the rows are safe in results.csv
  } catch (const std::exception& ex) {
    fmt::print(stderr, "attnbench: warning: the pattern of {} {} is not stored: {}\n", spec,
               describe(p, w), ex.what());
  }
}

void PatternStore::add(const Entry& e) {
  const std::string g = group_of(e.fields.front(), e.fields[causal_column()]);
  entries_[g] = e;
  order_.push_back(g);
  write_index();
}

void PatternStore::write_index() const {
  std::string text = csv_key(index_columns()) + '\n';
  for (const auto& g : order_) text += csv_key(entries_.at(g).fields) + '\n';
  write_file_atomic((fs::path(dir_) / "index.csv").string(), text);
}

}  // namespace attnbench
