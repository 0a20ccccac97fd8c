// .npy / .npz reading and writing, and loading q, k, v from an .npz.
#include "common/io/npy.h"

#include <gtest/gtest.h>
#include <zip.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::TempDir;

NpyArray random_f32(std::vector<int64_t> shape, uint32_t seed) {
  NpyArray a{"<f4", std::move(shape), {}};
  std::vector<float> x(size_t(a.numel()));
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(gen);
  a.data.resize(x.size() * sizeof(float));
  std::memcpy(a.data.data(), x.data(), a.data.size());
  return a;
}

float* floats(NpyArray& a) { return reinterpret_cast<float*>(a.data.data()); }

void expect_same(const NpyArray& a, const NpyArray& b) {
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.data, b.data);  // bit-identical bytes
}

template <class F>
std::string input_error(F&& f) {
  return test::error_message<InputError>(std::forward<F>(f));
}

// A valid q, k, v set: q [B, H, n, d], k and v [B, H, m, d].
std::map<std::string, NpyArray> qkv(int64_t b, int64_t h, int64_t n, int64_t m, int64_t d) {
  return {{"q", random_f32({b, h, n, d}, 1)},
          {"k", random_f32({b, h, m, d}, 2)},
          {"v", random_f32({b, h, m, d}, 3)}};
}

// ----- .npy -----

TEST(Npy, Float32RoundTripIsBitIdentical) {
  TempDir dir;
  NpyArray a = random_f32({2, 3, 5, 7}, 42);
  // awkward values must survive too
  floats(a)[0] = -0.0f;
  floats(a)[1] = std::numeric_limits<float>::denorm_min();
  floats(a)[2] = std::numeric_limits<float>::max();
  floats(a)[3] = std::numeric_limits<float>::infinity();
  floats(a)[4] = std::numeric_limits<float>::quiet_NaN();
  const std::string path = dir.file("a.npy");
  write_npy(path, a);
  expect_same(read_npy(path), a);

  // the file is what NumPy writes: magic, version 1.0, header padded to 64 bytes, '\n'
  const std::string bytes = test::read_text(path);
  ASSERT_GT(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t hlen = size_t(uint8_t(bytes[8])) | size_t(uint8_t(bytes[9])) << 8;
  EXPECT_EQ((10 + hlen) % 64, 0u);
  EXPECT_EQ(bytes[10 + hlen - 1], '\n');
  const std::string header = bytes.substr(10, hlen);
  EXPECT_CONTAINS(header, "'descr': '<f4'");
  EXPECT_CONTAINS(header, "'fortran_order': False");
  EXPECT_CONTAINS(header, "'shape': (2, 3, 5, 7)");
  EXPECT_EQ(bytes.size(), 10 + hlen + a.data.size());
}

TEST(Npy, Uint8AndOtherRanksRoundTrip) {
  TempDir dir;
  NpyArray u{"|u1", {3, 4}, {}};
  for (int i = 0; i < 12; ++i) u.data.push_back(char(i * 21));
  write_npy(dir.file("u.npy"), u);
  expect_same(read_npy(dir.file("u.npy")), u);

  NpyArray one = random_f32({5}, 7);  // 1-D: NumPy writes the shape as "(5,)"
  EXPECT_CONTAINS(encode_npy(one), "'shape': (5,)");
  expect_same(parse_npy(encode_npy(one), "one"), one);

  NpyArray scalar = random_f32({}, 8);  // 0-D: "()", one element
  EXPECT_CONTAINS(encode_npy(scalar), "'shape': ()");
  expect_same(parse_npy(encode_npy(scalar), "scalar"), scalar);

  NpyArray big = random_f32({1, 1, 1000, 33}, 9);
  expect_same(parse_npy(encode_npy(big), "big"), big);
}

TEST(Npy, ParsesVersion2Headers) {
  const std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }\n";
  std::string bytes("\x93NUMPY\x02\x00", 8);
  for (int i = 0; i < 4; ++i) bytes += char((header.size() >> (8 * i)) & 0xff);
  bytes += header;
  NpyArray want = random_f32({2, 2}, 3);
  bytes.append(want.data.begin(), want.data.end());
  expect_same(parse_npy(bytes, "v2"), want);
}

TEST(Npy, ParseErrors) {
  const std::string good = encode_npy(random_f32({2, 2, 3, 4}, 1));
  // truncated data: cut the last 5 bytes
  std::string msg = input_error([&] { parse_npy(good.substr(0, good.size() - 5), "cut.npy"); });
  EXPECT_CONTAINS(msg, "cut.npy");
  EXPECT_CONTAINS(msg, "truncated");
  // truncated header
  msg = input_error([&] { parse_npy(good.substr(0, 40), "head.npy"); });
  EXPECT_CONTAINS(msg, "truncated");
  // truncated before the header length
  EXPECT_THROW(parse_npy(good.substr(0, 7), "tiny.npy"), InputError);
  EXPECT_THROW(parse_npy("", "empty.npy"), InputError);
  // bad magic
  std::string bad = good;
  bad[1] = 'X';
  msg = input_error([&] { parse_npy(bad, "magic.npy"); });
  EXPECT_CONTAINS(msg, "magic.npy");
  EXPECT_CONTAINS(msg, "magic");
  EXPECT_THROW(parse_npy(std::string(200, 'a'), "text.npy"), InputError);
  // unknown format version
  bad = good;
  bad[6] = 9;
  EXPECT_THROW(parse_npy(bad, "v9.npy"), InputError);
  // Fortran order is refused, not silently transposed
  bad = good;
  const size_t f = bad.find("False");
  ASSERT_NE(f, std::string::npos);
  bad.replace(f, 5, "True ");
  msg = input_error([&] { parse_npy(bad, "fortran.npy"); });
  EXPECT_CONTAINS(msg, "Fortran");
}

TEST(Npy, FileErrors) {
  TempDir dir;
  EXPECT_CONTAINS(input_error([&] { read_npy(dir.file("missing.npy")); }), "missing.npy");
  EXPECT_CONTAINS(input_error([&] { read_npz(dir.file("missing.npz")); }), "missing.npz");
  // not a zip at all
  test::write_text(dir.file("plain.npz"), "this is not a zip archive, just some text\n");
  EXPECT_CONTAINS(input_error([&] { read_npz(dir.file("plain.npz")); }), "plain.npz");
  // an .npy given where an .npz is expected
  write_npy(dir.file("array.npy"), random_f32({2, 2}, 1));
  Problem p;
  EXPECT_CONTAINS(input_error([&] { load_inputs_npz(dir.file("array.npy"), &p); }), "array.npy");
}

// ----- .npz -----

TEST(Npz, RoundTrip) {
  TempDir dir;
  auto arrays = qkv(2, 3, 17, 9, 8);
  NpyArray u{"|u1", {4}, {1, 2, 3, 4}};
  arrays["mask"] = u;
  write_npz(dir.file("a.npz"), arrays);
  auto back = read_npz(dir.file("a.npz"));
  ASSERT_EQ(back.size(), arrays.size());
  for (const auto& [key, a] : arrays) {
    SCOPED_TRACE(key);
    ASSERT_TRUE(back.count(key));
    expect_same(back.at(key), a);
  }
  // writing again replaces the archive
  write_npz(dir.file("a.npz"), {{"x", u}});
  back = read_npz(dir.file("a.npz"));
  ASSERT_EQ(back.size(), 1u);
  expect_same(back.at("x"), u);
}

TEST(Npz, ReadsDeflatedArchives) {
  // np.savez_compressed deflates its members; build such an archive with libzip directly
  TempDir dir;
  const std::string path = dir.file("c.npz");
  auto arrays = qkv(1, 2, 30, 30, 16);
  std::vector<std::string> buffers;
  for (const auto& [key, a] : arrays) buffers.push_back(encode_npy(a));
  int err = 0;
  zip_t* z = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err);
  ASSERT_NE(z, nullptr);
  size_t i = 0;
  for (const auto& [key, a] : arrays) {
    zip_source_t* src = zip_source_buffer(z, buffers[i].data(), buffers[i].size(), 0);
    zip_int64_t idx = zip_file_add(z, (key + ".npy").c_str(), src, ZIP_FL_OVERWRITE);
    ASSERT_GE(idx, 0);
    ASSERT_EQ(zip_set_file_compression(z, zip_uint64_t(idx), ZIP_CM_DEFLATE, 9), 0);
    ++i;
  }
  ASSERT_EQ(zip_close(z), 0);
  auto back = read_npz(path);
  ASSERT_EQ(back.size(), 3u);
  for (const auto& [key, a] : arrays) expect_same(back.at(key), a);
}

TEST(Npz, LoadInputsFillsTheProblem) {
  TempDir dir;
  auto arrays = qkv(2, 3, 17, 9, 8);
  write_npz(dir.file("in.npz"), arrays);
  Problem p;
  p.batch = 7, p.heads = 7, p.n = 7, p.m = 0, p.dim = 7;
  Inputs in = load_inputs_npz(dir.file("in.npz"), &p);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.heads, 3);
  EXPECT_EQ(p.n, 17);
  EXPECT_EQ(p.keys(), 9);
  EXPECT_EQ(p.dim, 8);
  EXPECT_EQ(in.q.shape(), (Shape4{2, 3, 17, 8}));
  EXPECT_EQ(in.k.shape(), (Shape4{2, 3, 9, 8}));
  EXPECT_EQ(in.v.shape(), (Shape4{2, 3, 9, 8}));
  for (auto [t, key] :
       {std::pair<const Tensor*, const char*>{&in.q, "q"}, {&in.k, "k"}, {&in.v, "v"}})
    EXPECT_EQ(std::memcmp(t->data(), arrays.at(key).data.data(), arrays.at(key).data.size()), 0)
        << key;
  EXPECT_NO_THROW(p.validate());
  EXPECT_EQ(p.extra_inputs, nullptr);
  // any other array is an input of the variant beyond q, k and v (a gate, a decay, a
  // projection): float32, read into the problem by name; whether the variant takes it is the
  // variant's check (Variant::check_inputs)
  arrays["g"] = test::float_npy({2, 3}, {1, 2, 3, 4, 5, 6});
  write_npz(dir.file("extra.npz"), arrays);
  Problem p2;
  EXPECT_NO_THROW(load_inputs_npz(dir.file("extra.npz"), &p2));
  ASSERT_NE(p2.extra_inputs, nullptr);
  ASSERT_EQ(p2.extra_inputs->size(), 1u);
  EXPECT_EQ(p2.extra_inputs->at("g").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(p2.extra_inputs->at("g").data, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  arrays["extra"] = NpyArray{"|u1", {1}, {0}};
  write_npz(dir.file("extra.npz"), arrays);
  Problem p3;
  const std::string msg = input_error([&] { load_inputs_npz(dir.file("extra.npz"), &p3); });
  EXPECT_CONTAINS(msg, "'extra' has dtype |u1");
  EXPECT_CONTAINS(msg, "must be float32");
}

// Writes arrays to DIR/name and returns load_inputs_npz's error message.
std::string load_error(const TempDir& dir, const std::string& name,
                       const std::map<std::string, NpyArray>& arrays) {
  const std::string path = dir.file(name);
  write_npz(path, arrays);
  Problem p;
  std::string msg = input_error([&] { load_inputs_npz(path, &p); });
  EXPECT_CONTAINS(msg, path);
  return msg;
}

TEST(Npz, LoadInputsErrors) {
  TempDir dir;
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a.erase("v");
    std::string msg = load_error(dir, "no_v.npz", a);
    EXPECT_CONTAINS(msg, "'v'");
    EXPECT_CONTAINS(msg, "q, k");  // it says what it found
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    NpyArray d{"<f8", {1, 2, 5, 4}, std::vector<char>(1 * 2 * 5 * 4 * 8, 0)};
    a["q"] = d;
    std::string msg = load_error(dir, "f8.npz", a);
    EXPECT_CONTAINS(msg, "<f8");
    EXPECT_CONTAINS(msg, "float32");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a["k"].dtype = ">f4";  // big-endian float32 is not what we read
    EXPECT_CONTAINS(load_error(dir, "be.npz", a), ">f4");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a["q"].shape = {2, 5, 4};  // same bytes, three axes
    EXPECT_CONTAINS(load_error(dir, "3d.npz", a), "4 axes");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a["v"] = random_f32({1, 2, 6, 4}, 9);
    std::string msg = load_error(dir, "kv.npz", a);
    EXPECT_CONTAINS(msg, "k has shape (1, 2, 5, 4)");
    EXPECT_CONTAINS(msg, "(1, 2, 6, 4)");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a["q"] = random_f32({1, 2, 5, 3}, 9);
    EXPECT_CONTAINS(load_error(dir, "d.npz", a), "the same B and d");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a["q"] = random_f32({2, 2, 5, 4}, 9);
    EXPECT_CONTAINS(load_error(dir, "b.npz", a), "the same B and d");
  }
  {
    // key/value heads that do not divide the query heads
    auto a = qkv(1, 2, 5, 5, 4);
    a["q"] = random_f32({1, 3, 5, 4}, 9);
    EXPECT_CONTAINS(load_error(dir, "g.npz", a), "G dividing H");
  }
  {
    // grouped-query inputs: q [1, 4, 5, 4], k and v [1, 2, 5, 4]
    auto a = qkv(1, 2, 5, 5, 4);
    a["q"] = random_f32({1, 4, 5, 4}, 9);
    write_npz(dir.file("gqa.npz"), a);
    Problem p;
    Inputs in = load_inputs_npz(dir.file("gqa.npz"), &p);
    EXPECT_EQ(p.heads, 4);
    EXPECT_EQ(p.kv_head_count(), 2);
    EXPECT_EQ(in.k.shape(), (Shape4{1, 2, 5, 4}));
    EXPECT_EQ(in.k.view().shape, (Shape4{1, 4, 5, 4}));
    EXPECT_EQ(in.k.view().head(0, 3), in.k.data() + 5 * 4);  // query head 3 reads stored head 1
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    floats(a["q"])[((0 * 2 + 1) * 5 + 2) * 4 + 3] = std::numeric_limits<float>::quiet_NaN();
    std::string msg = load_error(dir, "nan.npz", a);
    EXPECT_CONTAINS(msg, "non-finite");
    EXPECT_CONTAINS(msg, "'q'");
    EXPECT_CONTAINS(msg, "[0, 1, 2, 3]");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    floats(a["v"])[39] = -std::numeric_limits<float>::infinity();
    std::string msg = load_error(dir, "inf.npz", a);
    EXPECT_CONTAINS(msg, "non-finite");
    EXPECT_CONTAINS(msg, "'v'");
    EXPECT_CONTAINS(msg, "[0, 1, 4, 3]");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a["k"].data.resize(a["k"].data.size() - 6);  // the header promises more than is there
    EXPECT_CONTAINS(load_error(dir, "cut.npz", a), "truncated");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a["q"] = NpyArray{"<f4", {1, 2, 0, 4}, {}};
    EXPECT_CONTAINS(load_error(dir, "empty.npz", a), "empty axis");
  }
  {
    auto a = qkv(1, 2, 5, 5, 4);
    a["v"] = NpyArray{"|u1", {1, 2, 5, 4}, std::vector<char>(40, 1)};
    EXPECT_CONTAINS(load_error(dir, "u1.npz", a), "float32");
  }
}

// ----- untrusted headers and archives: a clear InputError, never a crash or a huge allocation

// An .npy whose header declares `shape` (text as NumPy writes it) and holds `data_bytes` zeros.
std::string npy_with_shape(const std::string& shape, size_t data_bytes) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += char(header.size() & 0xff);
  out += char(header.size() >> 8);
  return out + header + std::string(data_bytes, '\0');
}

// An .npz of q, k, v as given (raw .npy bytes), each entry deflated or stored.
void write_raw_npz(const std::string& path, const std::map<std::string, std::string>& entries,
                   bool deflate) {
  int err = 0;
  zip_t* z = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err);
  ASSERT_NE(z, nullptr);
  for (const auto& [name, bytes] : entries) {
    zip_source_t* src = zip_source_buffer(z, bytes.data(), bytes.size(), 0);
    zip_int64_t idx = zip_file_add(z, name.c_str(), src, ZIP_FL_OVERWRITE);
    ASSERT_GE(idx, 0);
    ASSERT_EQ(zip_set_file_compression(z, zip_uint64_t(idx),
                                       deflate ? ZIP_CM_DEFLATE : ZIP_CM_STORE, deflate ? 9 : 0),
              0);
  }
  ASSERT_EQ(zip_close(z), 0);
}

std::map<std::string, std::string> encoded_qkv(int64_t b, int64_t h, int64_t n, int64_t m,
                                               int64_t d) {
  std::map<std::string, std::string> out;
  for (const auto& [key, a] : qkv(b, h, n, m, d)) out[key + ".npy"] = encode_npy(a);
  return out;
}

// Offsets of every occurrence of a zip signature ("PK\1\2": central directory, "PK\3\4": local
// header).
std::vector<size_t> find_all(const std::string& bytes, const std::string& sig) {
  std::vector<size_t> at;
  for (size_t i = bytes.find(sig); i != std::string::npos; i = bytes.find(sig, i + 1))
    at.push_back(i);
  return at;
}

void put_u32(std::string& bytes, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) bytes[at + size_t(i)] = char((v >> (8 * i)) & 0xff);
}

const std::string kCentral("PK\x01\x02", 4), kLocal("PK\x03\x04", 4);

// Start of the data of the first entry (after its local header, name and extra field).
size_t first_entry_data(const std::string& bytes) {
  const size_t at = find_all(bytes, kLocal).at(0);
  const size_t name = uint8_t(bytes[at + 26]) | size_t(uint8_t(bytes[at + 27])) << 8;
  const size_t extra = uint8_t(bytes[at + 28]) | size_t(uint8_t(bytes[at + 29])) << 8;
  return at + 30 + name + extra;
}

std::string npz_error(const std::string& path) {
  Problem p;
  std::string msg = input_error([&] { load_inputs_npz(path, &p); });
  EXPECT_CONTAINS(msg, path);
  // the same archive from memory gives the same message, naming what it was given
  const std::string bytes = test::read_text(path);
  EXPECT_EQ(input_error([&] { inputs_from_arrays(read_npz_buffer(bytes, path), path, &p); }), msg);
  return msg;
}

TEST(Npy, ShapeWhoseSizeOverflowsIsRefused) {
  // 2^32 * 2^32 elements wrap to 0 in int64: the file must not pass as holding its data
  const std::string bytes = npy_with_shape("(4294967296, 4294967296, 1, 1)", 64);
  std::string msg = input_error([&] { parse_npy(bytes, "wrap.npy"); });
  EXPECT_CONTAINS(msg, "wrap.npy");
  EXPECT_CONTAINS(msg, "(4294967296, 4294967296, 1, 1)");
  EXPECT_CONTAINS(msg, "overflows");
  // an element count that fits but whose byte count does not (2^62 * 4 bytes)
  msg = input_error([&] { parse_npy(npy_with_shape("(4611686018427387904,)", 0), "bytes.npy"); });
  EXPECT_CONTAINS(msg, "overflows");
  // an axis beyond int64, a negative axis, a shape that is not a tuple
  msg = input_error([&] { parse_npy(npy_with_shape("(99999999999999999999, 1)", 0), "big.npy"); });
  EXPECT_CONTAINS(msg, "big.npy");
  EXPECT_CONTAINS(msg, "2^63");
  msg = input_error([&] { parse_npy(npy_with_shape("(2, -1)", 0), "neg.npy"); });
  EXPECT_CONTAINS(msg, "non-negative integers");
  msg = input_error([&] { parse_npy(npy_with_shape("12", 64), "int.npy"); });
  EXPECT_CONTAINS(msg, "malformed .npy shape '12'");
  EXPECT_THROW(parse_npy(npy_with_shape("(1 2)", 64), "space.npy"), InputError);
  EXPECT_THROW(parse_npy(npy_with_shape("(1,,2)", 64), "commas.npy"), InputError);
  // what NumPy writes still parses
  EXPECT_EQ(parse_npy(npy_with_shape("(2, 3)", 24), "ok.npy").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(parse_npy(npy_with_shape("(5,)", 20), "ok.npy").shape, (std::vector<int64_t>{5}));
  // and NpyArray::numel refuses to wrap
  NpyArray a{"<f4", {int64_t(1) << 32, int64_t(1) << 32, 1, 1}, {}};
  EXPECT_THROW(a.numel(), InputError);
}

TEST(Npy, UnsupportedDtypesAreRefused) {
  NpyArray a = random_f32({2, 2}, 1);
  for (const char* descr : {"<f", "f4", "<f0", "<f4x", "<f99999999999999999999", "<<4"}) {
    SCOPED_TRACE(descr);
    a.dtype = descr;
    std::string msg = input_error([&] { parse_npy(encode_npy(a), "dtype.npy"); });
    EXPECT_CONTAINS(msg, "unsupported dtype");
    EXPECT_CONTAINS(msg, "'<f4'");  // it says what is accepted
  }
}

TEST(Npz, ShapeWhoseSizeOverflowsIsRefused) {
  // q, k and v declare 2^64 elements each and hold none: this used to load as a problem of
  // B = H = 2^32 over 64-byte buffers
  TempDir dir;
  const std::string npy = npy_with_shape("(4294967296, 4294967296, 1, 1)", 0);
  write_raw_npz(dir.file("wrap.npz"), {{"q.npy", npy}, {"k.npy", npy}, {"v.npy", npy}}, false);
  std::string msg = npz_error(dir.file("wrap.npz"));
  EXPECT_CONTAINS(msg, "k.npy");
  EXPECT_CONTAINS(msg, "overflows");
  // arrays made in code are checked the same way
  std::map<std::string, NpyArray> arrays;
  for (const char* key : {"q", "k", "v"})
    arrays[key] = NpyArray{"<f4", {int64_t(1) << 32, int64_t(1) << 32, 1, 1}, {}};
  Problem p;
  EXPECT_CONTAINS(input_error([&] { inputs_from_arrays(arrays, "made", &p); }), "bytes of data");
}

TEST(Npz, DeclaredSizesAreCheckedAgainstTheFile) {
  TempDir dir;
  for (bool deflate : {true, false}) {
    SCOPED_TRACE(deflate ? "deflated" : "stored");
    const std::string path = dir.file(deflate ? "deflated.npz" : "stored.npz");
    write_raw_npz(path, encoded_qkv(1, 1, 1, 1, 1), deflate);
    std::string bytes = test::read_text(path);
    ASSERT_LT(bytes.size(), 1000u);
    // every entry claims 3 GiB uncompressed, in the central directory and the local headers:
    // refused before anything is allocated
    for (size_t at : find_all(bytes, kCentral)) put_u32(bytes, at + 24, 3u << 30);
    for (size_t at : find_all(bytes, kLocal)) put_u32(bytes, at + 22, 3u << 30);
    const std::string huge = dir.file("huge.npz");
    test::write_text(huge, bytes);
    const auto start = std::chrono::steady_clock::now();
    std::string msg = npz_error(huge);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
    EXPECT_CONTAINS(msg, "entry 'k.npy'");  // the first entry, in name order
    EXPECT_CONTAINS(msg, "3221225472");
    EXPECT_CONTAINS(msg, deflate ? "more than deflate can expand" : "stored uncompressed");
    EXPECT_CONTAINS(msg, "np.savez");  // what is accepted
  }
}

TEST(Npz, BadCrcIsRefused) {
  TempDir dir;
  for (bool deflate : {true, false}) {
    SCOPED_TRACE(deflate ? "deflated" : "stored");
    const std::string path = dir.file("crc.npz");
    write_raw_npz(path, encoded_qkv(1, 2, 3, 3, 4), deflate);
    std::string bytes = test::read_text(path);
    // one flipped bit of data (the last float of k) is what only the CRC catches
    if (!deflate) {
      const size_t central = find_all(bytes, kCentral).at(0);
      const size_t size = uint8_t(bytes[central + 20]) | size_t(uint8_t(bytes[central + 21])) << 8;
      bytes[first_entry_data(bytes) + size - 1] ^= 0x01;
    } else {
      // or a CRC that does not match the data
      for (size_t at : find_all(bytes, kCentral)) bytes[at + 16] ^= 0x01;
      for (size_t at : find_all(bytes, kLocal)) bytes[at + 14] ^= 0x01;
    }
    test::write_text(path, bytes);
    std::string msg = npz_error(path);
    EXPECT_CONTAINS(msg, "entry 'k.npy'");
    EXPECT_CONTAINS(msg, "CRC");
  }
}

TEST(Npz, CorruptDeflateStreamIsReportedAsSuch) {
  TempDir dir;
  const std::string path = dir.file("deflate.npz");
  write_raw_npz(path, encoded_qkv(1, 2, 3, 3, 4), true);
  std::string bytes = test::read_text(path);
  const size_t data = first_entry_data(bytes);
  for (size_t i = data + 3; i < data + 9; ++i) bytes[i] ^= 0x5a;
  test::write_text(path, bytes);
  std::string msg = npz_error(path);
  EXPECT_CONTAINS(msg, "entry 'k.npy'");
  EXPECT_CONTAINS(msg, "corrupt");
  EXPECT_EQ(msg.find("shape"), std::string::npos) << msg;  // not mistaken for a bad header
}

TEST(Npz, ReadsArchivesFromMemory) {
  TempDir dir;
  auto arrays = qkv(1, 2, 3, 5, 4);
  write_npz(dir.file("a.npz"), arrays);
  auto back = read_npz_buffer(test::read_text(dir.file("a.npz")), "buffer");
  ASSERT_EQ(back.size(), 3u);
  for (const auto& [key, a] : arrays) expect_same(back.at(key), a);
  std::string msg = input_error([] { read_npz_buffer("not a zip", "the buffer"); });
  EXPECT_CONTAINS(msg, "the buffer");
  EXPECT_CONTAINS(msg, "np.savez");
}

TEST(Npy, EncodesLongHeadersAsVersion2) {
  // a header beyond 65535 bytes does not fit version 1.0's 16-bit length
  NpyArray a{"|u1", std::vector<int64_t>(25000, 1), {}};
  a.shape[0] = 3;
  a.data = {1, 2, 3};
  const std::string bytes = encode_npy(a);
  EXPECT_EQ(bytes[6], 2);
  expect_same(parse_npy(bytes, "long"), a);
}

}  // namespace
}  // namespace attnbench
