#include "common/io/trained.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "common/core/error.h"
#include "common/io/npy.h"

namespace attnbench {

namespace {

constexpr const char* kBuildHint =
    "build them with scripts/train_lm.py and scripts/capture_qkv.py (scripts/sweep.sh does "
    "both), or point ATTNBENCH_CACHE at a cache that has them";

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

bool regular_file(const std::string& path, struct stat* st = nullptr) {
  struct stat s {};
  if (::stat(path.c_str(), &s) != 0 || !S_ISREG(s.st_mode)) return false;
  if (st) *st = s;
  return true;
}

std::string layer_path(const TrainedMeta& meta, int64_t layer) {
  return fmt::format("{}/layer{}.npz", meta.dir, layer);
}

// The full arrays of one layer file, [1, heads, length, dim] each.
struct LayerArrays {
  off_t size = 0;
  int64_t mtime_ns = 0;
  std::shared_ptr<const Inputs> in;
};

std::mutex cache_mutex;
std::map<std::string, LayerArrays>& layer_cache() {
  static std::map<std::string, LayerArrays> cache;
  return cache;
}

// The checked arrays of `layer`, read once per file version.
std::shared_ptr<const Inputs> layer_arrays(const TrainedMeta& meta, int64_t layer) {
  const std::string path = layer_path(meta, layer);
  struct stat st {};
  if (!regular_file(path, &st))
    throw UsageError(fmt::format("trained inputs not found: {} is missing; {}", path, kBuildHint));
  const int64_t mtime = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto& cache = layer_cache();
  if (auto it = cache.find(path);
      it != cache.end() && it->second.size == st.st_size && it->second.mtime_ns == mtime)
    return it->second.in;
  cache.erase(path);
  Problem file;
  Inputs in;
  try {
    in = inputs_from_arrays(read_npz(path), path, &file);
  } catch (const InputError& e) {
    throw UsageError(fmt::format("trained inputs: {}", e.what()));
  }
  if (file.batch != 1 || file.heads != meta.heads || file.kv_head_count() != meta.heads ||
      file.n != meta.length || file.keys() != meta.length || file.dim != meta.dim)
    throw UsageError(fmt::format(
        "trained inputs: {} holds q of shape ({}, {}, {}, {}) and k, v of shape ({}, {}, {}, "
        "{}); expected [1, heads, length, dim] = [1, {}, {}, {}] for each, as {}/meta.json "
        "says; {}",
        path, file.batch, file.heads, file.n, file.dim, file.batch, file.kv_head_count(),
        file.keys(), file.dim, meta.heads, meta.length, meta.dim, meta.dir, kBuildHint));
  auto shared = std::make_shared<const Inputs>(std::move(in));
  cache[path] = LayerArrays{st.st_size, mtime, shared};
  return shared;
}

int64_t parse_layer(const std::string& value, const std::string& input) {
  int64_t v = -1;
  auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || ptr != value.data() + value.size() || v < 0)
    throw UsageError(fmt::format(
        "input '{}': layer '{}' is not a layer number; accepted: trained or trained:layer=L "
        "with L a layer of the model (0-based)",
        input, value));
  return v;
}

// The layer of a trained input name; throws UsageError for a malformed one.
int64_t parse_trained(const std::string& input) {
  if (input == "trained") return 0;
  if (!input.starts_with("trained:"))
    throw UsageError(
        fmt::format("input '{}' is not a trained input; accepted: trained or "
                    "trained:layer=L",
                    input));
  const std::string opts = input.substr(8);
  if (opts.empty())
    throw UsageError(fmt::format(
        "input '{}': no option after 'trained:'; accepted: trained or trained:layer=L", input));
  int64_t layer = -1;
  size_t start = 0;
  while (true) {
    const size_t comma = opts.find(',', start);
    const std::string item =
        opts.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    if (key != "layer" || eq == std::string::npos)
      throw UsageError(fmt::format(
          "input '{}': unknown option '{}'; trained inputs accept one option, layer=L (the "
          "model's layer, 0-based): trained or trained:layer=L",
          input, item));
    if (layer >= 0)
      throw UsageError(fmt::format(
          "input '{}': layer is given twice; accepted: trained or trained:layer=L", input));
    layer = parse_layer(item.substr(eq + 1), input);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return layer;
}

int64_t meta_int(const nlohmann::json& j, const char* key, const std::string& path) {
  if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() <= 0)
    throw UsageError(fmt::format(
        "trained inputs: {} has no positive integer '{}' ({}); expected format 1: format, "
        "layers, heads, dim, context, length and checkpoint; {}",
        path, key, j.contains(key) ? j[key].dump() : "missing", kBuildHint));
  return j[key].get<int64_t>();
}

}  // namespace

std::string cache_root() {
  if (std::string c = env("ATTNBENCH_CACHE"); !c.empty()) return c;
  if (std::string x = env("XDG_CACHE_HOME"); !x.empty()) return x + "/attnbench";
  if (std::string h = env("HOME"); !h.empty()) return h + "/.cache/attnbench";
  throw UsageError(
      "no attnbench cache: neither ATTNBENCH_CACHE, XDG_CACHE_HOME nor HOME is set; set "
      "ATTNBENCH_CACHE to the cache that holds trained/qkv");
}

std::string trained_dir() { return cache_root() + "/trained/qkv"; }

bool is_trained_input(const std::string& input) {
  return input == "trained" || input.starts_with("trained:");
}

std::optional<int64_t> trained_layer(const std::string& input) {
  if (!is_trained_input(input)) return std::nullopt;
  try {
    return parse_trained(input);
  } catch (const UsageError&) {
    return std::nullopt;
  }
}

std::string canonical_trained_input(const std::string& input) {
  return fmt::format("trained:layer={}", parse_trained(input));
}

TrainedMeta read_trained_meta() {
  TrainedMeta meta;
  meta.dir = trained_dir();
  const std::string path = meta.dir + "/meta.json";
  if (!regular_file(path))
    throw UsageError(fmt::format("trained inputs not found: {} is missing; {}", path, kBuildHint));
  {
    std::ifstream f(path, std::ios::binary);
    std::ostringstream s;
    s << f.rdbuf();
    meta.json = s.str();
  }
  const auto j = nlohmann::json::parse(meta.json, nullptr, false);
  if (!j.is_object())
    throw UsageError(fmt::format("trained inputs: {} is not a JSON object; {}", path, kBuildHint));
  meta.format = meta_int(j, "format", path);
  if (meta.format != 1)
    throw UsageError(
        fmt::format("trained inputs: {} has format {}; this attnbench reads format 1; {}", path,
                    meta.format, kBuildHint));
  meta.layers = meta_int(j, "layers", path);
  meta.heads = meta_int(j, "heads", path);
  meta.dim = meta_int(j, "dim", path);
  meta.context = meta_int(j, "context", path);
  meta.length = meta_int(j, "length", path);
  if (!j.contains("checkpoint") || !j["checkpoint"].is_string() ||
      j["checkpoint"].get<std::string>().size() < 12 ||
      j["checkpoint"].get<std::string>().find_first_not_of("0123456789abcdefABCDEF") !=
          std::string::npos)
    throw UsageError(fmt::format(
        "trained inputs: {} has no 'checkpoint' (the sha256 of the model's checkpoint, in "
        "hex); {}",
        path, kBuildHint));
  meta.checkpoint = j["checkpoint"].get<std::string>();
  return meta;
}

TrainedMeta check_trained_fits(const Problem& p, const std::string& input, int64_t head) {
  const int64_t layer = parse_trained(input);
  TrainedMeta meta = read_trained_meta();
  const std::string model = fmt::format("the model in {}", meta.dir);
  if (layer >= meta.layers)
    throw UsageError(fmt::format("input '{}': layer must be 0..{} for {}, got {}", input,
                                 meta.layers - 1, model, layer));
  if (head < 0 && p.batch != 1)
    throw UsageError(fmt::format(
        "input '{}': trained inputs are one sequence: batch must be 1, got {}", input, p.batch));
  if (head < 0 && p.heads != meta.heads)
    throw UsageError(fmt::format("input '{}': heads must be {} for {}, got {}", input, meta.heads,
                                 model, p.heads));
  if (head >= meta.heads)
    throw UsageError(fmt::format("input '{}': head must be 0..{} for {}, got {}", input,
                                 meta.heads - 1, model, head));
  if (p.dim != meta.dim)
    throw UsageError(
        fmt::format("input '{}': dim must be {} for {}, got {}", input, meta.dim, model, p.dim));
  if (p.keys() != p.n)
    throw UsageError(fmt::format(
        "input '{}': trained inputs are self-attention: m must equal n (no separate key "
        "length), got n = {} and m = {}",
        input, p.n, p.keys()));
  if (head < 0 && p.kv_heads != 0 && p.kv_heads != meta.heads)
    throw UsageError(fmt::format(
        "input '{}': kv_heads must be 0 or {} (the heads of {}, which has no grouped key/value "
        "heads), got {}",
        input, meta.heads, model, p.kv_heads));
  if (p.n > meta.length)
    throw UsageError(
        fmt::format("input '{}': n = {} exceeds the captured length {} of the trained inputs in {}",
                    input, p.n, meta.length, meta.dir));
  layer_arrays(meta, layer);
  return meta;
}

Inputs load_trained_inputs(const Problem& p, const std::string& input, int64_t head) {
  const TrainedMeta meta = check_trained_fits(p, input, head);
  const auto full = layer_arrays(meta, parse_trained(input));
  const int64_t n = p.n, d = p.dim, len = meta.length;
  // head h of a [1, heads, length, d] array, its first n positions, into a stored head
  auto copy = [&](const Tensor& from, int64_t h, float* to) {
    std::memcpy(to, from.data() + h * len * d, size_t(n * d) * sizeof(float));
  };
  if (head >= 0) {
    const Shape4 one{1, 1, n, d};
    Inputs in{Tensor(one), Tensor(one), Tensor(one)};
    copy(full->q, head, in.q.data());
    copy(full->k, head, in.k.data());
    copy(full->v, head, in.v.data());
    return in;
  }
  Inputs in{Tensor(p.q_shape()), p.kv_tensor(), p.kv_tensor()};
  for (int64_t h = 0; h < p.heads; ++h) {
    copy(full->q, h, in.q.data() + h * n * d);
    copy(full->k, h, in.k.data() + h * n * d);
    copy(full->v, h, in.v.data() + h * n * d);
  }
  return in;
}

std::string input_source(const std::string& input) {
  if (input == "file") return "file";
  if (!is_trained_input(input)) return "generated";
  return "trained@" + read_trained_meta().checkpoint.substr(0, 12);
}

std::string trained_context_note(const Problem& p, const std::string& input) {
  if (!is_trained_input(input)) return "";
  const TrainedMeta meta = read_trained_meta();
  if (p.n <= meta.context) return "";
  return fmt::format("beyond the trained context (C = {})", meta.context);
}

}  // namespace attnbench
