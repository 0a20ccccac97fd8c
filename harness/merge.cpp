#include "harness/merge.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "harness/output_dir.h"
#include "harness/patterns.h"
#include "harness/results.h"
#include "harness/shard.h"

namespace fs = std::filesystem;

namespace attnbench {

namespace {

// One shard's results directory as merge reads it.
struct Shard {
  std::string dir;
  nlohmann::json meta;
  std::vector<std::vector<std::string>> rows;  // csv_columns(), older layouts upgraded
  int index = -1;                              // meta shard.index; -1 for an unsharded sweep
};

// At most this many missing configurations are named in a message (the count is always given).
constexpr size_t kMaxNamed = 50;

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded())
    throw UsageError(fmt::format("'{}' is not valid JSON; expected what `attnbench sweep` writes",
                                 path.string()));
  return j;
}

std::string text_of(const nlohmann::json& meta, const char* key) {
  if (!meta.contains(key)) return "";
  const auto& v = meta[key];
  return v.is_string() ? v.get<std::string>() : v.dump();
}

// The rows of a CSV file with `columns` as its current layout (an older layout's lines are
// upgraded, as --resume does). Throws UsageError for another layout or a line whose field
// count does not match its header.
std::vector<std::vector<std::string>> read_rows(const fs::path& path,
                                                const std::vector<std::string>& columns,
                                                bool results = false) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line))
    throw UsageError(fmt::format("'{}' is empty; expected a header line and rows", path.string()));
  const auto header = split_csv_line(line);
  const bool upgrade = header != columns;
  if (upgrade && !upgrade_line(header, header, columns))
    throw UsageError(
        fmt::format("'{}' has different columns than this version of attnbench writes; merge "
                    "shards written by one attnbench",
                    path.string()));
  std::vector<std::vector<std::string>> rows;
  int64_t line_no = 1;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    auto f = split_csv_line(line);
    if (f.size() != header.size())
      throw UsageError(fmt::format("'{}' line {} has {} fields where the header has {}",
                                   path.string(), line_no, f.size(), header.size()));
    rows.push_back(upgrade ? *upgrade_line(header, f, columns) : f);
    if (results)
      if (const std::string why = malformed_reason(columns, rows.back()); !why.empty())
        throw UsageError(fmt::format(
            "'{}' line {} is not a row attnbench writes ({}); merge takes shards as their "
            "sweeps wrote them (`sweep --resume` on that shard sets such a line aside into "
            "results.malformed.csv and measures its configuration again)",
            path.string(), line_no, why));
  }
  return rows;
}

std::string key_of(const std::vector<std::string>& fields,
                   const std::vector<std::string>& columns) {
  std::vector<std::string> key;
  for (const auto& c : key_columns())
    key.push_back(fields[size_t(std::find(columns.begin(), columns.end(), c) - columns.begin())]);
  return csv_key(key);
}

std::string join_line(const std::vector<std::string>& fields) {
  return csv_key(fields);  // every field quoted where needed
}

void write_text(const fs::path& path, const std::string& text) {
  write_file_atomic(path.string(), text);
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) throw UsageError(fmt::format("cannot read '{}'", path.string()));
  return bytes;
}

// Names a configuration by its plan entry, else by its key.
std::string name_of(const std::string& key, const std::map<std::string, std::string>& names) {
  const auto it = names.find(key);
  return it != names.end() ? it->second : key;
}

// ----- the inputs and the output -----
// Each directory given: not the output, given once, not being written, a sweep's results
// directory; its meta.json read.
std::vector<Shard> read_shards(const MergeOptions& opt) {
  std::error_code ec;
  const fs::path out = fs::weakly_canonical(fs::absolute(opt.out), ec);
  std::set<fs::path> seen;
  std::vector<Shard> shards;
  for (const auto& dir : opt.dirs) {
    const fs::path d = fs::weakly_canonical(fs::absolute(dir), ec);
    if (d == out)
      throw UsageError(fmt::format(
          "--out '{}' is one of the directories to merge; accepted: a new directory (or one "
          "that is not an input)",
          opt.out));
    if (!seen.insert(d).second)
      throw UsageError(fmt::format("'{}' is given twice; give each shard's directory once", dir));
    require_not_being_written(dir);
    if (!fs::is_regular_file(fs::path(dir) / "results.csv"))
      throw UsageError(fmt::format(
          "'{}' has no results.csv; expected the --out directory of `attnbench sweep`", dir));
    if (!fs::is_regular_file(fs::path(dir) / "meta.json"))
      throw UsageError(fmt::format(
          "'{}' has no meta.json; expected the --out directory of `attnbench sweep`", dir));
    Shard s;
    s.dir = dir;
    s.meta = read_json(fs::path(dir) / "meta.json");
    if (!s.meta.is_object())
      throw UsageError(fmt::format("'{}/meta.json' is not a JSON object", dir));
    if (s.meta.contains("shard") && s.meta["shard"].is_object() &&
        s.meta["shard"].contains("index") && s.meta["shard"]["index"].is_number_integer())
      s.index = s.meta["shard"]["index"].get<int>();
    shards.push_back(std::move(s));
  }
  return shards;
}

// ----- the shards belong to one sweep -----
// The same git commit and sweep definition in every shard; different CPU models are refused
// with --strict, else a warning. Then the shards in the order of their index.
void check_one_sweep(std::vector<Shard>& shards, bool strict) {
  const Shard& first = shards.front();
  for (const char* field : {"git_commit", "sweep_definition"}) {
    if (!first.meta.contains(field))
      throw UsageError(fmt::format(
          "'{}/meta.json' has no {}; merge needs it from every shard (written by `attnbench "
          "sweep` since sharded sweeps exist; run the sweep again)",
          first.dir, field));
    for (const Shard& s : shards) {
      if (!s.meta.contains(field))
        throw UsageError(
            fmt::format("'{}/meta.json' has no {}; merge needs it from every shard", s.dir, field));
      if (s.meta[field] != first.meta[field])
        throw UsageError(fmt::format(
            "'{}' and '{}' have different {}s ({} and {}); merge only merges the shards of one "
            "sweep run by one attnbench{}",
            first.dir, s.dir, field == std::string("git_commit") ? "git commit" : field,
            text_of(first.meta, field), text_of(s.meta, field),
            field == std::string("git_commit")
                ? ""
                : " (the same configurations, reps, min-time, threads and seed)"));
    }
  }
  for (const Shard& s : shards)
    if (text_of(s.meta, "cpu_model") != text_of(first.meta, "cpu_model")) {
      const std::string what = fmt::format(
          "'{}' and '{}' ran on different CPU models ('{}' and '{}'): their times are not "
          "comparable",
          first.dir, s.dir, text_of(first.meta, "cpu_model"), text_of(s.meta, "cpu_model"));
      if (strict)
        throw UsageError(what + " (--strict refuses such shards; without it merge warns)");
      fmt::print(stderr, "attnbench: warning: {}\n", what);
    }
  std::stable_sort(shards.begin(), shards.end(), [](const Shard& a, const Shard& b) {
    return (a.index < 0 ? INT32_MAX : a.index) < (b.index < 0 ? INT32_MAX : b.index);
  });
}

// ----- the plan -----
// The sweep's plan.json, from the first shard that has one: the planned keys in order and the
// name of each configuration.
struct Plan {
  std::vector<std::string> planned;
  std::map<std::string, std::string> names;
  nlohmann::json json;  // null when no shard has plan.json
};

Plan read_plan(const std::vector<Shard>& shards) {
  const Shard& first = shards.front();
  Plan plan;
  for (const Shard& s : shards) {
    const fs::path p = fs::path(s.dir) / "plan.json";
    if (!fs::is_regular_file(p)) continue;
    plan.json = read_json(p);
    if (!plan.json.is_object() || !plan.json.contains("configs") ||
        !plan.json["configs"].is_array())
      throw UsageError(fmt::format("'{}' has no \"configs\" array", p.string()));
    if (plan.json.value("sweep_definition", "") != text_of(first.meta, "sweep_definition"))
      throw UsageError(fmt::format(
          "'{}' is of sweep definition {}, its meta.json of {}; the directory mixes two sweeps",
          p.string(), plan.json.value("sweep_definition", ""),
          text_of(first.meta, "sweep_definition")));
    for (const auto& c : plan.json["configs"]) {
      const std::string key = c.value("key", "");
      plan.planned.push_back(key);
      plan.names[key] = c.value("name", key);
    }
    break;
  }
  if (plan.json.is_null())
    fmt::print(stderr,
               "attnbench: warning: no shard has plan.json: missing configurations cannot be "
               "named and rows are kept in shard order\n");
  return plan;
}

// ----- the rows -----
// Every shard's rows by key: a configuration with different rows in two shards is refused, a
// planned one without a row is refused unless --allow-missing; the merged order is the plan's,
// then the rows not of the plan in shard order.
struct Rows {
  struct Found {
    size_t shard;
    std::vector<std::string> fields;
  };
  std::map<std::string, Found> found;
  std::vector<std::string> order;  // the keys of the merged results.csv
  size_t missing = 0;              // planned configurations without a row
};

// The configurations of two shards with different rows, refused.
void refuse_duplicates(const std::vector<std::string>& duplicates) {
  if (duplicates.empty()) return;
  std::string list;
  for (size_t i = 0; i < duplicates.size() && i < kMaxNamed; ++i) list += "\n  " + duplicates[i];
  if (duplicates.size() > kMaxNamed)
    list += fmt::format("\n  ... and {} more", duplicates.size() - kMaxNamed);
  throw UsageError(fmt::format(
      "{} configuration{} ha{} different rows in two shards (a shard run twice into two "
      "directories, or shards of two splits); merge the directories of one split:{}",
      duplicates.size(), duplicates.size() == 1 ? "" : "s", duplicates.size() == 1 ? "s" : "ve",
      list));
}

Rows collect_rows(std::vector<Shard>& shards, const Plan& plan, bool allow_missing) {
  const auto& columns = csv_columns();
  const auto& planned = plan.planned;
  Rows rows;
  std::vector<std::string> order;  // keys in the order the shards hold them
  std::vector<std::string> duplicates;
  for (size_t si = 0; si < shards.size(); ++si) {
    for (auto& f : read_rows(fs::path(shards[si].dir) / "results.csv", columns, true)) {
      const std::string key = key_of(f, columns);
      auto [it, fresh] = rows.found.try_emplace(key, Rows::Found{si, f});
      if (fresh) {
        order.push_back(key);
      } else if (it->second.fields != f) {
        duplicates.push_back(fmt::format("{} (in '{}' and in '{}')", name_of(key, plan.names),
                                         shards[it->second.shard].dir, shards[si].dir));
      }
    }
    shards[si].rows.clear();
  }
  refuse_duplicates(duplicates);
  std::vector<std::string> missing;
  std::set<std::string> planned_set(planned.begin(), planned.end());
  for (const auto& key : planned)
    if (!rows.found.count(key)) missing.push_back(key);
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < kMaxNamed; ++i)
      list += "\n  " + name_of(missing[i], plan.names);
    if (missing.size() > kMaxNamed)
      list += fmt::format("\n  ... and {} more", missing.size() - kMaxNamed);
    const std::string what = fmt::format(
        "{} of the sweep's {} configurations ha{} no row in any shard (a shard not run, or not "
        "finished: run it again with --resume):{}",
        missing.size(), planned.size(), missing.size() == 1 ? "s" : "ve", list);
    if (!allow_missing) throw UsageError(what + "\n(--allow-missing merges the rows there are)");
    fmt::print(stderr, "attnbench: warning: {}\n", what);
  }
  rows.missing = missing.size();
  for (const auto& key : planned)
    if (rows.found.count(key)) rows.order.push_back(key);
  size_t extra = 0;
  for (const auto& key : order)
    if (!planned_set.count(key)) rows.order.push_back(key), ++extra;
  if (extra > 0 && !planned.empty())
    fmt::print(stderr,
               "attnbench: warning: {} row{} not of the sweep's plan (kept from an earlier "
               "sweep resumed in a shard's directory) follow the planned rows\n",
               extra, extra == 1 ? " is" : "s are");
  return rows;
}

// ----- the patterns -----
struct PatternEntry {
  size_t position;
  std::vector<std::string> fields;
  fs::path source;  // the .npy to copy; empty for an entry without a file
};

// The column of the pattern file in patterns/index.csv.
size_t pattern_file_column() { return PatternStore::index_columns().size() - 2; }

// The shards' pattern index entries, one per (variant, causal) group, each with a whole
// pattern file (or none), in the order of the plan.
std::vector<PatternEntry> collect_patterns(const std::vector<Shard>& shards,
                                           const std::vector<std::string>& planned) {
  std::map<std::string, size_t> position;
  for (size_t i = 0; i < planned.size(); ++i) position.emplace(planned[i], i);
  const auto& index_cols = PatternStore::index_columns();
  const size_t causal_col =
      size_t(std::find(index_cols.begin(), index_cols.end(), "causal") - index_cols.begin());
  const size_t file_col = pattern_file_column();
  std::vector<PatternEntry> patterns;
  std::set<std::string> groups;
  for (const Shard& s : shards) {
    const fs::path index = fs::path(s.dir) / "patterns" / "index.csv";
    if (!fs::is_regular_file(index)) continue;
    for (auto& f : read_rows(index, index_cols)) {
      if (!groups.insert(f.front() + '\x1f' + f[causal_col]).second) continue;
      const std::vector<std::string> key(f.begin(), f.begin() + ptrdiff_t(key_columns().size()));
      const auto pos = position.find(csv_key(key));
      PatternEntry e{pos == position.end() ? planned.size() : pos->second, f, {}};
      if (!f[file_col].empty()) {
        e.source = fs::path(s.dir) / "patterns" / f[file_col];
        if (!fs::is_regular_file(e.source)) {
          fmt::print(stderr, "attnbench: warning: {} names {}, which does not exist; left out\n",
                     index.string(), e.source.string());
          groups.erase(f.front() + '\x1f' + f[causal_col]);
          continue;
        }
        if (const std::string why = pattern_file_problem(e.source.string()); !why.empty()) {
          fmt::print(stderr,
                     "attnbench: warning: {} names {}, which is not a whole pattern ({}); left "
                     "out\n",
                     index.string(), e.source.string(), why);
          groups.erase(f.front() + '\x1f' + f[causal_col]);
          continue;
        }
      }
      patterns.push_back(std::move(e));
    }
  }
  std::stable_sort(
      patterns.begin(), patterns.end(),
      [](const PatternEntry& a, const PatternEntry& b) { return a.position < b.position; });
  return patterns;
}

// ----- the merged meta -----
// The first shard's fields (but its own shard ones), the fields that differ named; a summary
// of each shard, the hosts, the summed and spanned figures and the row counts.
nlohmann::json merged_meta(const std::vector<Shard>& shards, const Plan& plan, const Rows& rows) {
  const Shard& first = shards.front();
  nlohmann::json meta = nlohmann::json::object();
  std::vector<std::string> differing;
  const std::set<std::string> own = {"shard", "earlier_runs", "earlier_command_lines"};
  for (const auto& [k, v] : first.meta.items()) {
    if (own.count(k)) continue;
    meta[k] = v;
    for (const Shard& s : shards)
      if (!s.meta.contains(k) || s.meta[k] != v) {
        differing.push_back(k);
        break;
      }
  }
  // the fields that differ keep the first shard's value, except those summed or spanned
  nlohmann::json summaries = nlohmann::json::array();
  std::set<std::string> hosts;
  double longest = 0, total = 0;
  for (const Shard& s : shards) {
    const std::string host = text_of(s.meta, "host");
    if (!host.empty()) hosts.insert(host);
    const double d = s.meta.contains("duration_s") && s.meta["duration_s"].is_number()
                         ? s.meta["duration_s"].get<double>()
                         : 0;
    longest = std::max(longest, d), total += d;
    nlohmann::json sum = {{"dir", fs::absolute(s.dir).lexically_normal().string()},
                          {"index", s.index >= 0 ? nlohmann::json(s.index) : nlohmann::json()}};
    for (const char* k : {"host", "cpu_model", "git_commit", "date", "duration_s", "threads",
                          "machine", "command_line", "rows_planned", "rows_noisy"})
      if (s.meta.contains(k)) sum[k] = s.meta[k];
    if (s.meta.contains("shard")) sum["shard"] = s.meta["shard"];
    summaries.push_back(sum);
  }
  const auto& columns = csv_columns();
  const size_t host_col =
      size_t(std::find(columns.begin(), columns.end(), "host") - columns.begin());
  for (const auto& s : shards)
    for (const auto& r : read_rows(fs::path(s.dir) / "results.csv", columns)) {
      const std::string& h = r[host_col];
      if (!h.empty()) hosts.insert(h);
    }
  for (const char* k : {"rows_noisy", "rows_kept_from_earlier_runs"}) {
    int64_t sum = 0;
    for (const Shard& s : shards)
      if (s.meta.contains(k) && s.meta[k].is_number_integer()) sum += s.meta[k].get<int64_t>();
    meta[k] = sum;
  }
  meta["merged_from"] = summaries.size();
  meta["shards"] = summaries;
  meta["hosts"] = hosts;
  meta["fields_differing"] = differing;
  meta["duration_s"] = longest;
  meta["duration_s_total"] = total;
  meta["rows_planned"] = plan.planned.empty() ? rows.order.size() : plan.planned.size();
  meta["rows"] = rows.order.size();
  meta["rows_missing"] = rows.missing;
  if (!plan.json.is_null()) meta["plan_file"] = "plan.json";
  return meta;
}

// ----- write -----
// An --out that holds results is refused without --force.
void refuse_held_results(const MergeOptions& opt) {
  if (opt.force) return;
  const auto held = held_results(opt.out);
  if (held.empty()) return;
  std::string list;
  for (const auto& h : held) list += (list.empty() ? "" : ", ") + h;
  throw UsageError(fmt::format(
      "--out '{}' already holds results ({}); merge writes a new directory: choose another "
      "--out, or --force to move them aside into '{}/earlier-<time>/' first",
      opt.out, list, opt.out));
}

// The shards' Google Benchmark records in one benchmark.json: the first context, every run.
nlohmann::json merged_benchmarks(const std::vector<Shard>& shards) {
  nlohmann::json bench = {{"context", nullptr}, {"benchmarks", nlohmann::json::array()}};
  for (const Shard& s : shards) {
    const fs::path p = fs::path(s.dir) / "benchmark.json";
    if (!fs::is_regular_file(p)) {
      fmt::print(stderr,
                 "attnbench: warning: '{}' has no benchmark.json; its rows are merged without "
                 "their Google Benchmark records\n",
                 s.dir);
      continue;
    }
    std::ifstream in(p);
    const auto b = nlohmann::json::parse(in, nullptr, false);
    if (!b.is_object() || !b.contains("benchmarks") || !b["benchmarks"].is_array()) {
      fmt::print(stderr,
                 "attnbench: warning: {} is not Google Benchmark JSON (an object with a "
                 "\"benchmarks\" array); its runs are left out\n",
                 p.string());
      continue;
    }
    if (bench["context"].is_null() && b.contains("context")) bench["context"] = b["context"];
    if (b.contains("benchmarks") && b["benchmarks"].is_array())
      for (const auto& r : b["benchmarks"]) bench["benchmarks"].push_back(r);
  }
  return bench;
}

// The merged directory, claimed: results.csv, benchmark.json, the patterns and their index,
// plan.json and meta.json.
void write_merged(const MergeOptions& opt, const std::vector<Shard>& shards, const Plan& plan,
                  const Rows& rows, const std::vector<PatternEntry>& patterns,
                  const nlohmann::json& meta) {
  refuse_held_results(opt);
  const DirLock lock = claim_results_dir(opt.out, /*resume=*/false, opt.force, "merge",
                                         /*resume_hint=*/false);
  std::error_code ec;
  const fs::path pat_dir = fs::path(opt.out) / "patterns";
  fs::create_directories(pat_dir, ec);
  if (ec) throw UsageError(fmt::format("cannot create '{}': {}", pat_dir.string(), ec.message()));
  std::string csv = join_line(csv_columns()) + '\n';
  for (const auto& key : rows.order) csv += join_line(rows.found.at(key).fields) + '\n';
  write_text(fs::path(opt.out) / "results.csv", csv);
  write_text(fs::path(opt.out) / "benchmark.json", merged_benchmarks(shards).dump(2) + '\n');
  const size_t file_col = pattern_file_column();
  std::string index = join_line(PatternStore::index_columns()) + '\n';
  for (const auto& e : patterns) {
    if (!e.source.empty())
      write_file_atomic((pat_dir / e.fields[file_col]).string(), read_bytes(e.source));
    index += join_line(e.fields) + '\n';
  }
  write_text(pat_dir / "index.csv", index);
  if (!plan.json.is_null()) write_text(fs::path(opt.out) / "plan.json", plan.json.dump(1) + '\n');
  write_text(fs::path(opt.out) / "meta.json", meta.dump(2) + '\n');
}

}  // namespace

size_t merge_results(const MergeOptions& opt) {
  if (opt.dirs.empty()) throw UsageError("merge: no results directory given; accepted: DIR...");
  std::vector<Shard> shards = read_shards(opt);
  check_one_sweep(shards, opt.strict);
  const Plan plan = read_plan(shards);
  const Rows rows = collect_rows(shards, plan, opt.allow_missing);
  const std::vector<PatternEntry> patterns = collect_patterns(shards, plan.planned);
  const nlohmann::json meta = merged_meta(shards, plan, rows);
  write_merged(opt, shards, plan, rows, patterns, meta);
  return rows.order.size();
}

}  // namespace attnbench
