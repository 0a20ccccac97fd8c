#include "common/npy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zip.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "common/error.h"

namespace attnbench {

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

namespace {

int64_t itemsize(const std::string& descr) {
  if (descr.size() < 3) return 0;
  return std::atoll(descr.c_str() + 2);
}

// Extracts the value text for key in the header dict "{'descr': '<f4', ...}".
std::string dict_value(const std::string& header, const std::string& key, const std::string& what) {
  auto pos = header.find("'" + key + "'");
  if (pos == std::string::npos)
    throw InputError(fmt::format("{}: .npy header has no '{}' field: {}", what, key, header));
  pos = header.find(':', pos);
  if (pos == std::string::npos) throw InputError(fmt::format("{}: malformed .npy header", what));
  ++pos;
  while (pos < header.size() && header[pos] == ' ') ++pos;
  size_t end = pos;
  if (header[pos] == '(') {
    end = header.find(')', pos);
    if (end == std::string::npos) throw InputError(fmt::format("{}: malformed .npy shape", what));
    return header.substr(pos, end - pos + 1);
  }
  if (header[pos] == '\'') {
    end = header.find('\'', pos + 1);
    if (end == std::string::npos) throw InputError(fmt::format("{}: malformed .npy header", what));
    return header.substr(pos + 1, end - pos - 1);
  }
  end = header.find_first_of(",}", pos);
  return header.substr(pos, end - pos);
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
    for (int i = 0; i < 4; ++i) header_len |= size_t(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    offset = 12;
  } else {
    throw InputError(fmt::format("{}: unsupported .npy format version {}", what, major));
  }
  if (bytes.size() < offset + header_len)
    throw InputError(fmt::format("{}: truncated .npy header", what));
  std::string header = bytes.substr(offset, header_len);
  NpyArray a;
  a.dtype = dict_value(header, "descr", what);
  if (dict_value(header, "fortran_order", what) != "False")
    throw InputError(fmt::format("{}: Fortran-order arrays are not accepted; save a C-order "
                                 "array (np.ascontiguousarray)",
                                 what));
  std::string shape = dict_value(header, "shape", what);
  for (size_t i = 1; i + 1 < shape.size();) {
    while (i + 1 < shape.size() && (shape[i] == ' ' || shape[i] == ',')) ++i;
    if (i + 1 >= shape.size()) break;
    char* end = nullptr;
    long long v = std::strtoll(shape.c_str() + i, &end, 10);
    if (end == shape.c_str() + i || v < 0)
      throw InputError(fmt::format("{}: malformed .npy shape {}", what, shape));
    a.shape.push_back(v);
    i = size_t(end - shape.c_str());
  }
  const int64_t isz = itemsize(a.dtype);
  if (isz <= 0) throw InputError(fmt::format("{}: unsupported dtype '{}'", what, a.dtype));
  const size_t want = size_t(a.numel() * isz), have = bytes.size() - offset - header_len;
  if (have < want)
    throw InputError(fmt::format("{}: truncated data: shape ({}) of {} needs {} bytes, the "
                                 "file has {}",
                                 what, fmt::join(a.shape, ", "), a.dtype, want, have));
  a.data.assign(bytes.begin() + std::ptrdiff_t(offset + header_len),
                bytes.begin() + std::ptrdiff_t(offset + header_len + want));
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
  // Pad with spaces so magic + length + header + '\n' is a multiple of 64.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += char(header.size() & 0xff);
  out += char(header.size() >> 8);
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

std::map<std::string, NpyArray> read_npz(const std::string& path) {
  int err = 0;
  std::unique_ptr<zip_t, int (*)(zip_t*)> z(zip_open(path.c_str(), ZIP_RDONLY, &err), zip_close);
  if (!z) {
    zip_error_t ze;
    zip_error_init_with_code(&ze, err);
    std::string msg = zip_error_strerror(&ze);
    zip_error_fini(&ze);
    throw InputError(fmt::format("cannot read '{}' as .npz (a zip of .npy files): {}", path, msg));
  }
  std::map<std::string, NpyArray> out;
  const zip_int64_t entries = zip_get_num_entries(z.get(), 0);
  for (zip_int64_t i = 0; i < entries; ++i) {
    zip_stat_t st;
    if (zip_stat_index(z.get(), zip_uint64_t(i), 0, &st) != 0)
      throw InputError(fmt::format("{}: unreadable entry {}", path, i));
    std::string name = st.name;
    std::unique_ptr<zip_file_t, int (*)(zip_file_t*)> f(zip_fopen_index(z.get(), zip_uint64_t(i), 0),
                                                       zip_fclose);
    if (!f) throw InputError(fmt::format("{}: cannot open entry '{}'", path, name));
    std::string bytes(size_t(st.size), '\0');
    zip_int64_t got = zip_fread(f.get(), bytes.data(), st.size);
    if (got != zip_int64_t(st.size))
      throw InputError(fmt::format("{}: entry '{}' is truncated or corrupt", path, name));
    std::string key = name.size() > 4 && name.ends_with(".npy") ? name.substr(0, name.size() - 4) : name;
    out[key] = parse_npy(bytes, fmt::format("{}:{}", path, name));
  }
  return out;
}

void write_npz(const std::string& path, const std::map<std::string, NpyArray>& arrays) {
  int err = 0;
  std::unique_ptr<zip_t, void (*)(zip_t*)> z(zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err),
                                            zip_discard);
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

Inputs load_inputs_npz(const std::string& path, Problem* p) {
  auto arrays = read_npz(path);
  auto take = [&](const char* key) -> NpyArray& {
    auto it = arrays.find(key);
    if (it == arrays.end()) {
      std::vector<std::string> keys;
      for (const auto& [k, a] : arrays) keys.push_back(k);
      throw InputError(fmt::format("{}: no array '{}'; the file must hold float32 arrays q, k, v "
                                   "of shape [B, H, len, d]; it holds: {}",
                                   path, key, keys.empty() ? "nothing" : fmt::format("{}", fmt::join(keys, ", "))));
    }
    NpyArray& a = it->second;
    if (a.dtype != "<f4")
      throw InputError(fmt::format("{}: '{}' has dtype {}, expected float32 ('<f4'); convert with "
                                   ".astype(np.float32)",
                                   path, key, a.dtype));
    if (a.shape.size() != 4)
      throw InputError(fmt::format("{}: '{}' has shape ({}), expected 4 axes [B, H, len, d]", path,
                                   key, fmt::join(a.shape, ", ")));
    for (int64_t s : a.shape)
      if (s <= 0)
        throw InputError(fmt::format("{}: '{}' has an empty axis: shape ({})", path, key,
                                     fmt::join(a.shape, ", ")));
    return a;
  };
  NpyArray &q = take("q"), &k = take("k"), &v = take("v");
  if (k.shape != v.shape)
    throw InputError(fmt::format("{}: k has shape ({}) but v has shape ({}); they must match",
                                 path, fmt::join(k.shape, ", "), fmt::join(v.shape, ", ")));
  if (q.shape[0] != k.shape[0] || q.shape[1] != k.shape[1] || q.shape[3] != k.shape[3])
    throw InputError(fmt::format("{}: q has shape ({}) and k ({}); B, H and d must agree", path,
                                 fmt::join(q.shape, ", "), fmt::join(k.shape, ", ")));
  p->batch = q.shape[0];
  p->heads = q.shape[1];
  p->n = q.shape[2];
  p->m = k.shape[2];
  p->dim = q.shape[3];
  p->input = "file";
  Inputs in{Tensor(p->q_shape()), Tensor(p->kv_shape()), Tensor(p->kv_shape())};
  auto copy = [&](const char* key, const NpyArray& a, Tensor& t) {
    std::memcpy(t.data(), a.data.data(), a.data.size());
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(t.data()[i])) {
        const Shape4& s = t.shape();
        int64_t c = i % s.dim, r = i / s.dim % s.len, h = i / s.dim / s.len % s.heads,
                b = i / s.dim / s.len / s.heads;
        throw InputError(fmt::format("{}: '{}' holds a non-finite value ({}) at [{}, {}, {}, {}]; "
                                     "inputs must be finite",
                                     path, key, t.data()[i], b, h, r, c));
      }
  };
  copy("q", q, in.q);
  copy("k", k, in.k);
  copy("v", v, in.v);
  return in;
}

}  // namespace attnbench
