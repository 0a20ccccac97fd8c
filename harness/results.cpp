#include "harness/results.h"

#include <fmt/format.h>

#include <filesystem>
#include <iterator>

#include "common/error.h"

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

std::string quote(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

const std::vector<std::string> kKeyColumns = {"spec", "batch", "heads", "n", "m", "dim", "causal",
                                              "input", "scale", "seed", "threads"};

std::string join_key(const std::vector<std::string>& fields) {
  std::string k;
  for (const auto& f : fields) k += f + '\x1f';
  return k;
}

}  // namespace

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
    line += quote(field_text(value));
  }
  return line;
}

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') out.back() += '"', ++i;
      else if (c == '"') quoted = false;
      else out.back() += c;
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

std::string row_key(const Row& row) {
  auto j = to_json(row);
  std::vector<std::string> f;
  for (const auto& c : kKeyColumns) f.push_back(field_text(j[c]));
  return join_key(f);
}

ResultsDir::ResultsDir(const std::string& dir, bool resume) : dir_(dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError(fmt::format("cannot create results directory '{}': {}", dir, ec.message()));
  const fs::path csv_path = fs::path(dir) / "results.csv", json_path = fs::path(dir) / "benchmark.json";
  bool have_header = false;
  if (resume && fs::exists(csv_path)) {
    // A line without its newline was torn by an interrupted write: drop it so the next row
    // starts on a line of its own (that configuration simply runs again).
    std::string text;
    {
      std::ifstream in(csv_path, std::ios::binary);
      text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    if (!text.empty() && text.back() != '\n') {
      const size_t keep = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
      fs::resize_file(csv_path, keep);
    }
  }
  if (resume && fs::exists(csv_path) && fs::file_size(csv_path) > 0) {
    std::ifstream in(csv_path);
    std::string line;
    std::getline(in, line);
    auto header = split_csv_line(line);
    if (header != csv_columns())
      throw UsageError(fmt::format("cannot resume: '{}' has different columns than this version of "
                                   "attnbench writes; use a new --out directory",
                                   csv_path.string()));
    have_header = true;
    std::vector<size_t> idx;
    for (const auto& c : kKeyColumns)
      idx.push_back(size_t(std::find(header.begin(), header.end(), c) - header.begin()));
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      auto f = split_csv_line(line);
      if (f.size() != header.size()) continue;  // a torn last line from an interrupted write
      std::vector<std::string> key;
      for (size_t i : idx) key.push_back(f[i]);
      done_.insert(join_key(key));
    }
    if (fs::exists(json_path)) {
      std::ifstream j(json_path);
      bench_ = nlohmann::json::parse(j, nullptr, false);
      if (bench_.is_discarded()) bench_ = nlohmann::json();
    }
  }
  csv_.open(csv_path, have_header ? std::ios::app : std::ios::trunc);
  if (!csv_) throw UsageError(fmt::format("cannot write '{}'", csv_path.string()));
  if (!have_header) {
    std::string header;
    for (const auto& c : csv_columns()) header += (header.empty() ? "" : ",") + c;
    csv_ << header << '\n' << std::flush;
  }
  if (!bench_.is_object()) bench_ = {{"context", nullptr}, {"benchmarks", nlohmann::json::array()}};
  write_benchmark_json();  // without --resume, this replaces an earlier run's file at once
}

void ResultsDir::append(const Row& row, const nlohmann::json& bench) {
  csv_ << csv_line(row) << '\n' << std::flush;
  done_.insert(row_key(row));
  if (bench.is_object() && bench.contains("benchmarks")) {
    if (bench_["context"].is_null()) bench_["context"] = bench["context"];
    for (const auto& b : bench["benchmarks"]) bench_["benchmarks"].push_back(b);
    write_benchmark_json();
  }
}

void ResultsDir::write_benchmark_json() const {
  // write then rename, so an interrupted run never leaves a torn file
  const fs::path path = fs::path(dir_) / "benchmark.json", tmp = fs::path(dir_) / "benchmark.json.tmp";
  {
    std::ofstream f(tmp);
    f << bench_.dump(2) << '\n';
  }
  fs::rename(tmp, path);
}

void ResultsDir::write_meta(const nlohmann::json& meta) const {
  const fs::path path = fs::path(dir_) / "meta.json";
  nlohmann::json out = meta;
  // A resumed directory holds rows of earlier sweeps too: keep their command lines, oldest
  // first, so the directory still says how all of its rows were made.
  if (rows_kept() > 0 && fs::exists(path)) {
    std::ifstream in(path);
    const auto old = nlohmann::json::parse(in, nullptr, false);
    if (old.is_object()) {
      nlohmann::json earlier = nlohmann::json::array();
      if (old.contains("earlier_command_lines") && old["earlier_command_lines"].is_array())
        earlier = old["earlier_command_lines"];
      if (old.contains("command_line")) earlier.push_back(old["command_line"]);
      out["earlier_command_lines"] = earlier;
    }
  }
  std::ofstream f(path);
  f << out.dump(2) << '\n';
}

}  // namespace attnbench
