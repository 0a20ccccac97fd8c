#include "common/io/npy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zip.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string_view>

#include "common/core/checked.h"
#include "common/core/error.h"

namespace attnbench {

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t s : shape)
    if ((n = checked_mul(n, s)) < 0)
      throw InputError(fmt::format("shape ({}) has more elements than an int64 can count",
                                   fmt::join(shape, ", ")));
  return n;
}

namespace {

constexpr const char* kNpyDtypes =
    "accepted: a NumPy type string of byte order, kind and size, such as '<f4' (float32), "
    "'<f8' or '|u1'";

// Bytes per element of a simple NumPy descr ("<f4", "|u1", "<U10"), or 0 if it is not one.
int64_t itemsize(const std::string& descr) {
  if (descr.size() < 3 || descr.size() > 12 ||
      std::string_view("<>|=").find(descr[0]) == std::string_view::npos ||
      !std::isalpha(static_cast<unsigned char>(descr[1])))
    return 0;
  int64_t n = 0;
  const char* first = descr.data() + 2;
  const char* last = descr.data() + descr.size();
  auto [end, ec] = std::from_chars(first, last, n);
  if (ec != std::errc() || end != last || n <= 0 || n > (int64_t(1) << 30)) return 0;
  return descr[1] == 'U' ? 4 * n : n;  // a unicode string of n characters is UCS-4
}

// The header as quoted in error messages: at most its first 200 bytes.
std::string excerpt(const std::string& header) {
  return header.size() <= 200 ? header : header.substr(0, 200) + "...";
}

// Extracts the value text for key in the header dict "{'descr': '<f4', ...}".
std::string dict_value(const std::string& header, const std::string& key, const std::string& what) {
  auto pos = header.find("'" + key + "'");
  if (pos == std::string::npos)
    throw InputError(
        fmt::format("{}: .npy header has no '{}' field: {}", what, key, excerpt(header)));
  pos = header.find(':', pos);
  if (pos == std::string::npos)
    throw InputError(fmt::format("{}: malformed .npy header (no ':' after '{}'): {}", what, key,
                                 excerpt(header)));
  ++pos;
  while (pos < header.size() && header[pos] == ' ') ++pos;
  if (pos >= header.size())
    throw InputError(fmt::format("{}: malformed .npy header (no value for '{}'): {}", what, key,
                                 excerpt(header)));
  size_t end = pos;
  if (header[pos] == '(') {
    end = header.find(')', pos);
    if (end == std::string::npos)
      throw InputError(
          fmt::format("{}: malformed .npy shape (no closing ')'): {}", what, excerpt(header)));
    return header.substr(pos, end - pos + 1);
  }
  if (header[pos] == '\'') {
    end = header.find('\'', pos + 1);
    if (end == std::string::npos)
      throw InputError(fmt::format("{}: malformed .npy header (unterminated string for '{}'): {}",
                                   what, key, excerpt(header)));
    return header.substr(pos + 1, end - pos - 1);
  }
  end = header.find_first_of(",}", pos);
  return header.substr(pos, end == std::string::npos ? end : end - pos);
}

// Parses "(2, 8, 1024, 64)", "(5,)" or "()".
std::vector<int64_t> parse_shape(const std::string& text, const std::string& what) {
  auto bad = [&](const char* why) {
    return InputError(
        fmt::format("{}: malformed .npy shape '{}' ({}); accepted: a tuple of "
                    "non-negative integers such as (2, 8, 1024, 64), (5,) or ()",
                    what, excerpt(text), why));
  };
  if (text.size() < 2 || text.front() != '(' || text.back() != ')') throw bad("not a tuple");
  std::vector<int64_t> shape;
  const char* p = text.data() + 1;
  const char* const last = text.data() + text.size() - 1;  // the ')'
  auto skip_spaces = [&] {
    while (p < last && *p == ' ') ++p;
  };
  skip_spaces();
  while (p < last) {
    int64_t v = 0;
    auto [end, ec] = std::from_chars(p, last, v);
    if (ec == std::errc::result_out_of_range) throw bad("an axis exceeds 2^63 - 1");
    if (ec != std::errc() || end == p || v < 0) throw bad("an axis is not a non-negative integer");
    shape.push_back(v);
    p = end;
    skip_spaces();
    if (p < last && *p != ',') throw bad("axes must be separated by ','");
    if (p < last) ++p;
    skip_spaces();
  }
  return shape;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

NpyArray parse_npy(const std::string& bytes, const std::string& what) {
  static const char magic[] = "\x93NUMPY";
  if (bytes.size() < 10 || std::memcmp(bytes.data(), magic, 6) != 0)
    throw InputError(fmt::format("{}: not a .npy array (bad magic)", what));
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw InputError(fmt::format("{}: truncated .npy header", what));
    for (int i = 0; i < 4; ++i)
      header_len |= size_t(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    offset = 12;
  } else {
    throw InputError(
        fmt::format("{}: unsupported .npy format version {}; accepted: 1, 2 or 3", what, major));
  }
  if (bytes.size() < offset + header_len)
    throw InputError(fmt::format("{}: truncated .npy header: it declares {} bytes, the file has {}",
                                 what, header_len, bytes.size() - offset));
  std::string header = bytes.substr(offset, header_len);
  NpyArray a;
  a.dtype = dict_value(header, "descr", what);
  if (dict_value(header, "fortran_order", what) != "False")
    throw InputError(
        fmt::format("{}: Fortran-order arrays are not accepted; save a C-order "
                    "array (np.ascontiguousarray)",
                    what));
  a.shape = parse_shape(dict_value(header, "shape", what), what);
  const int64_t isz = itemsize(a.dtype);
  if (isz <= 0)
    throw InputError(fmt::format("{}: unsupported dtype '{}'; {}", what, a.dtype, kNpyDtypes));
  const size_t have = bytes.size() - offset - header_len;
  // Every product is checked: a shape whose element count wraps to 0 would pass the
  // truncation check below and send whoever reads the array off the end of its data.
  int64_t want = isz;
  for (int64_t s : a.shape) want = checked_mul(want, s);
  if (want < 0)
    throw InputError(
        fmt::format("{}: shape ({}) of {} needs more than 2^63 bytes (the element "
                    "count overflows int64), the file has {}",
                    what, fmt::join(a.shape, ", "), a.dtype, have));
  if (have < uint64_t(want))
    throw InputError(
        fmt::format("{}: truncated data: shape ({}) of {} needs {} bytes, the "
                    "file has {}",
                    what, fmt::join(a.shape, ", "), a.dtype, want, have));
  a.data.assign(bytes.begin() + std::ptrdiff_t(offset + header_len),
                bytes.begin() + std::ptrdiff_t(offset + header_len + size_t(want)));
  return a;
}

std::string encode_npy(const NpyArray& a) {
  std::string shape = "(";
  for (size_t i = 0; i < a.shape.size(); ++i) shape += fmt::format("{}, ", a.shape[i]);
  if (a.shape.size() > 1) shape.resize(shape.size() - 2);
  if (a.shape.size() == 1) shape.resize(shape.size() - 1);
  shape += ")";
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", a.dtype, shape);
  // Format 1.0 has a 16-bit header length; longer headers (thousands of axes) need 2.0, as
  // NumPy does. Pad with spaces so magic + length + header + '\n' is a multiple of 64.
  const bool v2 = 10 + header.size() + 1 + 63 > 0xffff;
  const size_t prefix = v2 ? 12 : 10;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out(v2 ? "\x93NUMPY\x02\x00" : "\x93NUMPY\x01\x00", 8);
  for (size_t i = 0; i < prefix - 8; ++i) out += char((header.size() >> (8 * i)) & 0xff);
  out += header;
  out.append(a.data.begin(), a.data.end());
  return out;
}

void write_npy(const std::string& path, const NpyArray& a) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw InputError(fmt::format("cannot write '{}': {}", path, std::strerror(errno)));
  std::string bytes = encode_npy(a);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  if (!f) throw InputError(fmt::format("writing '{}' failed", path));
}

NpyArray read_npy(const std::string& path) { return parse_npy(slurp(path), path); }

namespace {

constexpr const char* kNpzAccepted =
    "accepted: a zip archive of .npy files, stored or deflated, as np.savez and "
    "np.savez_compressed write them";
// Deflate emits at least 2 bits per 258-byte match, so no entry expands beyond 1032 times
// its compressed size.
constexpr uint64_t kMaxDeflateRatio = 1032;

using ZipArchive = std::unique_ptr<zip_t, void (*)(zip_t*)>;

std::string zip_error_text(int code) {
  zip_error_t ze;
  zip_error_init_with_code(&ze, code);
  std::string msg = zip_error_strerror(&ze);
  zip_error_fini(&ze);
  return msg;
}

// Reads every entry of the archive z, `archive_bytes` long and named `what` in messages. The
// sizes the zip directory declares are checked against the archive and the memory available
// before anything is allocated, and each entry's CRC is checked.
std::map<std::string, NpyArray> read_entries(zip_t* z, uint64_t archive_bytes,
                                             const std::string& what) {
  std::map<std::string, NpyArray> out;
  const uint64_t memory = uint64_t(available_memory_bytes());
  uint64_t total = 0;  // uncompressed bytes of the entries so far
  const zip_int64_t entries = zip_get_num_entries(z, 0);
  for (zip_int64_t i = 0; i < entries; ++i) {
    zip_stat_t st;
    zip_stat_init(&st);
    if (zip_stat_index(z, zip_uint64_t(i), 0, &st) != 0)
      throw InputError(fmt::format("{}: zip entry {} is unreadable: {}; {}", what, i,
                                   zip_strerror(z), kNpzAccepted));
    const std::string name =
        (st.valid & ZIP_STAT_NAME) && st.name ? std::string(st.name) : fmt::format("#{}", i);
    const std::string entry = fmt::format("{}: entry '{}'", what, name);
    constexpr zip_uint64_t need = ZIP_STAT_SIZE | ZIP_STAT_COMP_SIZE | ZIP_STAT_COMP_METHOD;
    if ((st.valid & need) != need)
      throw InputError(
          fmt::format("{} has no size or compression method in the zip directory; "
                      "{}",
                      entry, kNpzAccepted));
    if ((st.valid & ZIP_STAT_ENCRYPTION_METHOD) && st.encryption_method != ZIP_EM_NONE)
      throw InputError(fmt::format("{} is encrypted; {}", entry, kNpzAccepted));
    if (st.comp_method != ZIP_CM_STORE && st.comp_method != ZIP_CM_DEFLATE)
      throw InputError(fmt::format("{} uses zip compression method {}; {}", entry, st.comp_method,
                                   kNpzAccepted));
    if (st.comp_size > archive_bytes)
      throw InputError(
          fmt::format("{} declares {} compressed bytes, more than the whole archive "
                      "({} bytes); the file is truncated or corrupt; {}",
                      entry, st.comp_size, archive_bytes, kNpzAccepted));
    if (st.comp_method == ZIP_CM_STORE && st.size != st.comp_size)
      throw InputError(
          fmt::format("{} is stored uncompressed, yet declares {} bytes of data in "
                      "{} bytes; the zip directory is corrupt; {}",
                      entry, st.size, st.comp_size, kNpzAccepted));
    if (st.comp_method == ZIP_CM_DEFLATE && st.size > st.comp_size * kMaxDeflateRatio)
      throw InputError(
          fmt::format("{} declares {} bytes uncompressed from {} compressed bytes, "
                      "more than deflate can expand ({}x); the zip directory is "
                      "corrupt; {}",
                      entry, st.size, st.comp_size, kMaxDeflateRatio, kNpzAccepted));
    if (st.size > memory || total + st.size > memory)
      throw InputError(
          fmt::format("{} declares {} bytes uncompressed, {} with the entries before "
                      "it, more than the {} bytes of memory available",
                      entry, st.size, total + st.size, memory));
    total += st.size;

    std::unique_ptr<zip_file_t, int (*)(zip_file_t*)> f(zip_fopen_index(z, zip_uint64_t(i), 0),
                                                        zip_fclose);
    if (!f)
      throw InputError(
          fmt::format("{} cannot be opened: {}; {}", entry, zip_strerror(z), kNpzAccepted));
    std::string bytes(size_t(st.size), '\0');
    zip_int64_t got = zip_fread(f.get(), bytes.data(), st.size);
    // One more read must meet the end of the entry; reaching it makes libzip check the CRC.
    char extra = 0;
    zip_int64_t more = got == zip_int64_t(st.size) ? zip_fread(f.get(), &extra, 1) : 0;
    if (got < 0 || more < 0) {
      zip_error_t* ze = zip_file_get_error(f.get());
      const int code = zip_error_code_zip(ze);
      const std::string detail = zip_error_strerror(ze);
      if (code == ZIP_ER_CRC)
        throw InputError(
            fmt::format("{} fails its CRC check: its data is corrupt; {}", entry, kNpzAccepted));
      if (code == ZIP_ER_COMPRESSED_DATA)
        throw InputError(
            fmt::format("{} is corrupt: its deflate stream cannot be decoded ({}); "
                        "{}",
                        entry, detail, kNpzAccepted));
      throw InputError(
          fmt::format("{} is corrupt or unreadable: {}; {}", entry, detail, kNpzAccepted));
    }
    if (got != zip_int64_t(st.size) || more != 0)
      throw InputError(fmt::format(
          "{} holds {} bytes, but the zip directory declares {}; the "
          "archive is corrupt; {}",
          entry, more != 0 ? "more than " + std::to_string(st.size) : std::to_string(got), st.size,
          kNpzAccepted));
    std::string key =
        name.size() > 4 && name.ends_with(".npy") ? name.substr(0, name.size() - 4) : name;
    out[key] = parse_npy(bytes, fmt::format("{}:{}", what, name));
  }
  return out;
}

}  // namespace

std::map<std::string, NpyArray> read_npz(const std::string& path) {
  int err = 0;
  ZipArchive z(zip_open(path.c_str(), ZIP_RDONLY, &err), zip_discard);
  if (!z)
    throw InputError(
        fmt::format("cannot read '{}' as .npz: {}; {}", path, zip_error_text(err), kNpzAccepted));
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  return read_entries(z.get(), ec ? UINT64_MAX : uint64_t(size), path);
}

std::map<std::string, NpyArray> read_npz_buffer(std::string_view bytes, const std::string& what) {
  zip_error_t ze;
  zip_error_init(&ze);
  zip_source_t* src = zip_source_buffer_create(bytes.data(), bytes.size(), 0, &ze);
  if (!src) {
    std::string msg = zip_error_strerror(&ze);
    zip_error_fini(&ze);
    throw InputError(fmt::format("cannot read {} as .npz: {}", what, msg));
  }
  ZipArchive z(zip_open_from_source(src, ZIP_RDONLY, &ze), zip_discard);
  if (!z) {
    zip_source_free(src);
    std::string msg = zip_error_strerror(&ze);
    zip_error_fini(&ze);
    throw InputError(fmt::format("cannot read {} as .npz: {}; {}", what, msg, kNpzAccepted));
  }
  zip_error_fini(&ze);
  return read_entries(z.get(), bytes.size(), what);
}

void write_npz(const std::string& path, const std::map<std::string, NpyArray>& arrays) {
  int err = 0;
  std::unique_ptr<zip_t, void (*)(zip_t*)> z(
      zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err), zip_discard);
  if (!z) throw InputError(fmt::format("cannot create '{}'", path));
  std::vector<std::string> buffers;
  buffers.reserve(arrays.size());
  for (const auto& [key, a] : arrays) {
    buffers.push_back(encode_npy(a));
    zip_source_t* src = zip_source_buffer(z.get(), buffers.back().data(), buffers.back().size(), 0);
    zip_int64_t idx = zip_file_add(z.get(), (key + ".npy").c_str(), src, ZIP_FL_OVERWRITE);
    if (idx < 0) {
      zip_source_free(src);
      throw InputError(fmt::format("cannot add '{}' to '{}'", key, path));
    }
    zip_set_file_compression(z.get(), zip_uint64_t(idx), ZIP_CM_STORE, 0);
  }
  if (zip_close(z.get()) != 0) throw InputError(fmt::format("cannot write '{}'", path));
  z.release();
}

NpyArray to_npy(const Tensor& t) {
  const Shape4& s = t.shape();
  NpyArray a{"<f4", {s.batch, s.heads, s.len, s.dim}, {}};
  a.data.resize(size_t(t.numel()) * sizeof(float));
  std::memcpy(a.data.data(), t.data(), a.data.size());
  return a;
}

namespace {

// The weights of p's score from the arrays w_bilinear [H, d, d] (bilinear) or w_q, w_k [H, h, d]
// and w_score [H, h] (additive), float32 and finite. A file holding none of the score's arrays
// leaves the weights to the seed (p->score_weights untouched); one holding some must hold all.
// The additive hidden size comes from w_q when p->score_hidden is 0, and must agree otherwise.
void score_weights_from_arrays(const std::map<std::string, NpyArray>& arrays,
                               const std::string& path, Problem* p) {
  if (p->score != Score::bilinear && p->score != Score::additive) return;
  const bool bilinear = p->score == Score::bilinear;
  const std::vector<std::string> names = bilinear
                                             ? std::vector<std::string>{"w_bilinear"}
                                             : std::vector<std::string>{"w_q", "w_k", "w_score"};
  int present = 0;
  for (const auto& name : names) present += arrays.count(name) ? 1 : 0;
  if (present == 0) return;
  const int64_t H = p->heads, d = p->dim;
  int64_t hd = p->hidden();
  if (!bilinear && p->score_hidden == 0) {
    auto it = arrays.find("w_q");
    if (it != arrays.end() && it->second.shape.size() == 3 && it->second.shape[1] > 0)
      hd = it->second.shape[1];
  }
  auto expected = [&](const std::string& name) -> std::vector<int64_t> {
    if (name == "w_bilinear") return {H, d, d};
    if (name == "w_score") return {H, hd};
    return {H, hd, d};
  };
  auto sw = std::make_shared<ScoreWeights>();
  sw->heads = H, sw->dim = d, sw->hidden = bilinear ? 0 : hd;
  for (const auto& name : names) {
    const std::vector<int64_t> want = expected(name);
    const std::string accepted =
        fmt::format("the {} score reads float32 arrays {} (H = {}, d = {}{})", score_name(p->score),
                    bilinear ? "w_bilinear [H, d, d]" : "w_q, w_k [H, h, d] and w_score [H, h]", H,
                    d, bilinear ? "" : fmt::format(", h = {}", hd));
    auto it = arrays.find(name);
    if (it == arrays.end())
      throw InputError(fmt::format("{}: no array '{}'; {}", path, name, accepted));
    const NpyArray& a = it->second;
    if (a.dtype != "<f4" || a.shape != want || a.data.size() != size_t(a.numel()) * sizeof(float))
      throw InputError(fmt::format(
          "{}: '{}' has dtype {} and shape ({}); expected float32 of "
          "shape ({}): {}",
          path, name, a.dtype, fmt::join(a.shape, ", "), fmt::join(want, ", "), accepted));
    std::vector<float>& dst = name == "w_bilinear" ? sw->w_bilinear
                              : name == "w_q"      ? sw->w_q
                              : name == "w_k"      ? sw->w_k
                                                   : sw->w_score;
    dst.resize(size_t(a.numel()));
    std::memcpy(dst.data(), a.data.data(), a.data.size());
    for (size_t i = 0; i < dst.size(); ++i)
      if (!std::isfinite(dst[i]))
        throw InputError(
            fmt::format("{}: '{}' holds a non-finite value ({}) at flat index {}; "
                        "weights must be finite",
                        path, name, dst[i], i));
  }
  if (!bilinear) p->score_hidden = hd;
  p->score_weights = std::move(sw);
}

// Every array that is not q, k, v, do, a score weight or attn_mask is an input of the variant
// beyond q, k and v (VariantInfo::inputs): float32 and finite here; whether the variant takes
// it, and in which shape, is the variant's check (Variant::check_inputs).
void extra_inputs_from_arrays(const std::map<std::string, NpyArray>& arrays,
                              const std::string& path, Problem* p) {
  static const std::set<std::string> known = {"q",   "k",   "v",       "do",       "w_bilinear",
                                              "w_q", "w_k", "w_score", "attn_mask"};
  auto extra = std::make_shared<ExtraInputs>();
  for (const auto& [name, a] : arrays) {
    if (known.count(name)) continue;
    if (a.dtype != "<f4" || a.data.size() != size_t(a.numel()) * sizeof(float))
      throw InputError(fmt::format(
          "{}: '{}' has dtype {} and shape ({}); an array beyond q, k, v, do and the score "
          "weights is an input of the variant (a gate, a decay, a projection: `attnbench list` "
          "names them) and must be float32",
          path, name, a.dtype, fmt::join(a.shape, ", ")));
    ExtraInput t{a.shape, std::vector<float>(size_t(a.numel()))};
    std::memcpy(t.data.data(), a.data.data(), a.data.size());
    for (size_t i = 0; i < t.data.size(); ++i)
      if (!std::isfinite(t.data[i]))
        throw InputError(fmt::format(
            "{}: '{}' holds a non-finite value ({}) at flat index {}; inputs must be finite", path,
            name, t.data[i], i));
    extra->emplace(name, std::move(t));
  }
  if (!extra->empty()) p->extra_inputs = std::move(extra);
}

}  // namespace

Inputs load_inputs_npz(const std::string& path, Problem* p) {
  return inputs_from_arrays(read_npz(path), path, p);
}

Inputs inputs_from_arrays(std::map<std::string, NpyArray> arrays, const std::string& path,
                          Problem* p) {
  auto take = [&](const char* key) -> NpyArray& {
    auto it = arrays.find(key);
    if (it == arrays.end()) {
      std::vector<std::string> keys;
      for (const auto& [k, a] : arrays) keys.push_back(k);
      throw InputError(fmt::format(
          "{}: no array '{}'; the file must hold float32 arrays q, k, v "
          "of shape [B, H, len, d]; it holds: {}",
          path, key, keys.empty() ? "nothing" : fmt::format("{}", fmt::join(keys, ", "))));
    }
    NpyArray& a = it->second;
    if (a.dtype != "<f4")
      throw InputError(
          fmt::format("{}: '{}' has dtype {}, expected float32 ('<f4'); convert with "
                      ".astype(np.float32)",
                      path, key, a.dtype));
    if (a.shape.size() != 4)
      throw InputError(fmt::format("{}: '{}' has shape ({}), expected 4 axes [B, H, len, d]", path,
                                   key, fmt::join(a.shape, ", ")));
    for (int64_t s : a.shape)
      if (s <= 0)
        throw InputError(fmt::format("{}: '{}' has an empty axis: shape ({})", path, key,
                                     fmt::join(a.shape, ", ")));
    // The tensors are sized from the shape and filled from the data: they must agree, and
    // no product may wrap.
    int64_t bytes = int64_t(sizeof(float));
    for (int64_t s : a.shape) bytes = checked_mul(bytes, s);
    if (bytes < 0 || uint64_t(bytes) != a.data.size())
      throw InputError(
          fmt::format("{}: '{}' has shape ({}) but {} bytes of data; float32 needs "
                      "4 bytes per element",
                      path, key, fmt::join(a.shape, ", "), a.data.size()));
    return a;
  };
  NpyArray &q = take("q"), &k = take("k"), &v = take("v");
  if (k.shape != v.shape)
    throw InputError(fmt::format("{}: k has shape ({}) but v has shape ({}); they must match", path,
                                 fmt::join(k.shape, ", "), fmt::join(v.shape, ", ")));
  if (q.shape[0] != k.shape[0] || q.shape[3] != k.shape[3] || q.shape[1] % k.shape[1] != 0)
    throw InputError(fmt::format(
        "{}: q has shape ({}) and k ({}); accepted: q [B, H, n, d] and k, v [B, G, m, d] with "
        "the same B and d and G dividing H (G = H: multi-head, G < H: grouped-query attention)",
        path, fmt::join(q.shape, ", "), fmt::join(k.shape, ", ")));
  p->batch = q.shape[0];
  p->heads = q.shape[1];
  p->kv_heads = k.shape[1];
  p->n = q.shape[2];
  p->m = k.shape[2];
  p->dim = q.shape[3];
  Inputs in{Tensor(p->q_shape()), p->kv_tensor(), p->kv_tensor()};
  auto copy = [&](const char* key, const NpyArray& a, Tensor& t) {
    std::memcpy(t.data(), a.data.data(), a.data.size());
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(t.data()[i])) {
        const Shape4& s = t.shape();
        int64_t c = i % s.dim, r = i / s.dim % s.len, h = i / s.dim / s.len % s.heads,
                b = i / s.dim / s.len / s.heads;
        throw InputError(
            fmt::format("{}: '{}' holds a non-finite value ({}) at [{}, {}, {}, {}]; "
                        "inputs must be finite",
                        path, key, t.data()[i], b, h, r, c));
      }
  };
  copy("q", q, in.q);
  copy("k", k, in.k);
  copy("v", v, in.v);
  // the upstream gradient of the training passes, optional: the shape of q
  if (arrays.count("do")) {
    NpyArray& g = take("do");
    if (g.shape != q.shape)
      throw InputError(fmt::format("{}: 'do' has shape ({}) but q has ({}); they must match", path,
                                   fmt::join(g.shape, ", "), fmt::join(q.shape, ", ")));
    in.dout = Tensor(p->q_shape());
    copy("do", g, in.dout);
  }
  score_weights_from_arrays(arrays, path, p);
  extra_inputs_from_arrays(arrays, path, p);
  return in;
}

std::shared_ptr<const AttnMask> attn_mask_from_array(const NpyArray& a, const std::string& what,
                                                     const Problem& p) {
  const int64_t m = p.keys();
  const std::string accepted = fmt::format(
      "accepted: float32 (added to the logits, -inf = masked out) or bool/uint8 (true = "
      "masked out) of shape [n, m] = [{}, {}] or [B or 1, H or 1, n, m] = [{} or 1, {} or 1, "
      "{}, {}]",
      p.n, m, p.batch, p.heads, p.n, m);
  const bool is_float = a.dtype == "<f4", is_bool = a.dtype == "|b1" || a.dtype == "|u1";
  if (!is_float && !is_bool)
    throw InputError(fmt::format("{}: attention mask of dtype '{}'; {}", what, a.dtype, accepted));
  auto mask = std::make_shared<AttnMask>();
  const auto& sh = a.shape;
  if (sh.size() == 2) {
    mask->n = sh[0], mask->m = sh[1];
  } else if (sh.size() == 4) {
    mask->batch = sh[0], mask->heads = sh[1], mask->n = sh[2], mask->m = sh[3];
  } else {
    mask->n = -1;
  }
  if (mask->n != p.n || mask->m != m || (mask->batch != 1 && mask->batch != p.batch) ||
      (mask->heads != 1 && mask->heads != p.heads))
    throw InputError(
        fmt::format("{}: attention mask of shape [{}]; {}", what, fmt::join(sh, ", "), accepted));
  const int64_t count = a.numel();
  mask->bias.resize(size_t(count));
  mask->is_bool = is_bool;
  if (is_bool) {
    for (int64_t e = 0; e < count; ++e)
      mask->bias[size_t(e)] = a.data[size_t(e)] != 0 ? -INFINITY : 0.0f;
  } else {
    std::memcpy(mask->bias.data(), a.data.data(), size_t(count) * sizeof(float));
    for (int64_t e = 0; e < count; ++e) {
      const float x = mask->bias[size_t(e)];
      if (std::isnan(x) || x == INFINITY)
        throw InputError(fmt::format(
            "{}: attention mask holds {} at flat index {}; {} (finite values and -inf only)", what,
            x, e, accepted));
    }
  }
  return mask;
}

std::shared_ptr<const AttnMask> load_attn_mask(const std::string& path, const Problem& p) {
  std::shared_ptr<AttnMask> mask;
  const bool npz = path.size() >= 4 && path.compare(path.size() - 4, 4, ".npz") == 0;
  std::shared_ptr<const AttnMask> read;
  if (npz) {
    auto arrays = read_npz(path);
    auto it = arrays.find("attn_mask");
    if (it == arrays.end())
      throw InputError(fmt::format(
          "{}: no array 'attn_mask'; an .npz attention mask holds it under that name", path));
    read = attn_mask_from_array(it->second, path, p);
  } else {
    read = attn_mask_from_array(read_npy(path), path, p);
  }
  mask = std::make_shared<AttnMask>(*read);
  mask->name = std::filesystem::path(path).filename().string();
  return mask;
}

}  // namespace attnbench
