// The allocation hook (harness/memory_hook.cpp, linked into this executable through
// attnbench_objects) and the memory figures built on it.
#include "harness/memory.h"

#include <benchmark/benchmark.h>
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

constexpr int64_t kSize = 8 << 20;    // 8 MiB
constexpr int64_t kSlack = 64 << 10;  // allocator overhead allowed on top of the request
constexpr int64_t kNoise = 4 << 10;   // drift allowed between two readings with nothing live

// Makes the compiler believe the block is used, so neither the allocation nor the writes
// are optimised away.
volatile char g_sink;
void touch(void* p, int64_t bytes) {
  std::memset(p, 0x5a, size_t(bytes));
  benchmark::DoNotOptimize(p);
  g_sink = static_cast<volatile char*>(p)[bytes - 1];
}

struct Figures {
  int64_t base = 0, during = 0, peak = 0, after = 0, allocs = 0;
};

// base: current bytes before; during: with the block live; peak: since the reset; after: once
// the block is released. Readings are taken first and checked afterwards, so gtest's own
// allocations cannot disturb them.
Figures measure(const std::function<void*()>& alloc, const std::function<void(void*)>& release,
                int64_t touch_bytes = kSize) {
  Figures f;
  const int64_t allocs0 = heap_allocations();
  f.base = heap_reset_peak();
  void* p = alloc();
  if (!p) return f;
  touch(p, touch_bytes);
  f.during = heap_current_bytes();
  f.peak = heap_peak_bytes();
  f.allocs = heap_allocations() - allocs0;
  release(p);
  f.after = heap_current_bytes();
  return f;
}

void expect_counted(const Figures& f, int64_t size = kSize) {
  EXPECT_GE(f.peak - f.base, size);
  EXPECT_LT(f.peak - f.base, size + kSlack);
  EXPECT_GE(f.during - f.base, size);
  EXPECT_LT(f.during - f.base, size + kSlack);
  EXPECT_GE(f.allocs, 1);
  EXPECT_NEAR(double(f.after), double(f.base), double(kNoise));
}

TEST(HeapHook, NewArray) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  expect_counted(measure([] { return static_cast<void*>(new char[kSize]); },
                         [](void* p) { delete[] static_cast<char*>(p); }));
}

TEST(HeapHook, Malloc) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  expect_counted(measure([] { return std::malloc(kSize); }, [](void* p) { std::free(p); }));
}

TEST(HeapHook, Calloc) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  expect_counted(
      measure([] { return std::calloc(kSize / 16, 16); }, [](void* p) { std::free(p); }));
}

TEST(HeapHook, PosixMemalign) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  expect_counted(measure(
      [] {
        void* p = nullptr;
        return posix_memalign(&p, 64, kSize) == 0 ? p : nullptr;
      },
      [](void* p) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
        std::free(p);
      }));
  void* p = nullptr;
  EXPECT_EQ(posix_memalign(&p, 3, 64), EINVAL);  // not a power of two
}

TEST(HeapHook, AlignedAllocAndMemalign) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  expect_counted(measure([] { return std::aligned_alloc(4096, kSize); },
                         [](void* p) {
                           EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);
                           std::free(p);
                         }));
  expect_counted(measure([] { return memalign(256, kSize); }, [](void* p) { std::free(p); }));
}

TEST(HeapHook, ReallocGrowthShrinkAndFree) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  // grow 1 MiB -> 8 MiB: what is counted is the 8 MiB block, not both
  expect_counted(measure(
      [] {
        void* p = std::malloc(1 << 20);
        touch(p, 1 << 20);
        return std::realloc(p, kSize);
      },
      [](void* p) { std::free(p); }));
  // realloc(nullptr, n) is malloc(n)
  expect_counted(
      measure([] { return std::realloc(nullptr, kSize); }, [](void* p) { std::free(p); }));
  // shrink 8 MiB -> 1 MiB: the count follows the block down
  Figures f = measure(
      [] {
        void* p = std::malloc(kSize);
        touch(p, kSize);
        return std::realloc(p, 1 << 20);
      },
      [](void* p) { std::free(p); }, 1 << 20);
  EXPECT_GE(f.peak - f.base, kSize);
  EXPECT_GE(f.during - f.base, 1 << 20);
  EXPECT_LT(f.during - f.base, (1 << 20) + kSlack);
  EXPECT_NEAR(double(f.after), double(f.base), double(kNoise));
  // realloc(p, 0) frees p (glibc)
  volatile size_t zero = 0;
  const int64_t base = heap_current_bytes();
  void* p = std::malloc(kSize);
  benchmark::DoNotOptimize(p);
  const int64_t during = heap_current_bytes();
  void* q = std::realloc(p, zero);
  benchmark::DoNotOptimize(q);  // clang elides a realloc whose result is only freed
  const int64_t after = heap_current_bytes();
  std::free(q);
  const int64_t freed = heap_current_bytes();
  EXPECT_GE(during - base, kSize);
  EXPECT_LT(after - base, kNoise);
  EXPECT_NEAR(double(freed), double(base), double(kNoise));
}

TEST(HeapHook, OtherThreadsAreCounted) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  const int64_t base = heap_reset_peak();
  std::thread t([] {
    void* p = std::malloc(kSize);
    touch(p, kSize);
    std::free(p);
  });
  t.join();
  const int64_t peak = heap_peak_bytes();
  EXPECT_GE(peak - base, kSize);
  EXPECT_LT(peak - base, kSize + kSlack);
}

TEST(HeapHook, ResetPeakReturnsCurrent) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  void* p = std::malloc(kSize);
  touch(p, kSize);
  std::free(p);
  // the peak now includes the freed block; a reset brings it back to the current level
  EXPECT_GE(heap_peak_bytes(), heap_current_bytes());
  const int64_t cur = heap_reset_peak();
  EXPECT_EQ(heap_peak_bytes(), cur);
  EXPECT_NEAR(double(cur), double(heap_current_bytes()), double(kNoise));
}

TEST(PeakScope, ReportsPeakAboveStart) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  // a block live before the scope opens is not part of the figure
  void* before = std::malloc(2 * kSize);
  touch(before, 2 * kSize);
  PeakScope scope;
  void* p = std::malloc(kSize);
  touch(p, kSize);
  std::free(p);
  const int64_t peak = scope.peak_bytes(), allocs = scope.allocations();
  std::free(before);
  EXPECT_GE(peak, kSize);
  EXPECT_LT(peak, kSize + kSlack);
  EXPECT_GE(allocs, 1);
}

// run_one with several repetitions: every memory figure in the row and in Google Benchmark's
// JSON is one the harness measured. (Debian's Google Benchmark 1.7.1 hands out stale pointers
// to its MemoryManager results after the first repetition, which once put garbage in
// max_bytes_used; the harness registers no MemoryManager.)
TEST(PeakScope, RunOneReportsMeasuredPeaksOnly) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  auto v = make_variant("full");
  Problem p;
  p.batch = 1, p.heads = 2, p.n = 256, p.dim = 32;
  Workload w;
  w.threads = 1;
  const double scores = double(p.heads * p.n * p.n) * 4;
  MachineFigures mf;
  RunOptions opt{.reps = 4, .min_time = 0.01};
  nlohmann::json bench;
  Row row = run_one(*v, p, w, nullptr, mf, opt, nullptr, &bench);
  ASSERT_EQ(row.status, "ok") << row.message;
  EXPECT_GE(row.peak_bytes, scores);
  EXPECT_LE(row.peak_bytes, 2 * v->memory_estimate(p));
  int iteration_runs = 0;
  for (const auto& b : bench["benchmarks"]) {
    EXPECT_FALSE(b.contains("max_bytes_used")) << b.dump();
    EXPECT_FALSE(b.contains("allocs_per_iter")) << b.dump();
    if (b["run_type"] != "iteration") continue;
    ++iteration_runs;
    ASSERT_TRUE(b.contains("peak_bytes")) << b.dump();
    EXPECT_GE(b["peak_bytes"].get<double>(), scores);
    EXPECT_LE(b["peak_bytes"].get<double>(), row.peak_bytes);
  }
  EXPECT_EQ(iteration_runs, 4);
}

// Google Benchmark writes a counter's coefficient of variation over repetitions that are all
// 0 as a bare NaN, which is not JSON; the harness reads it as null.
TEST(PeakScope, BenchmarkJsonWithNonFiniteFiguresParses) {
  const std::string text = R"({"benchmarks": [{"name": "a:inf=1", "peak_bytes": NaN,
    "x": -nan, "y": inf, "z": -Infinity, "label": "NaN", "w": 1.5}]})";
  auto j = parse_benchmark_json(text);
  const auto& b = j.at("benchmarks").at(0);
  EXPECT_EQ(b.at("name"), "a:inf=1");
  EXPECT_TRUE(b.at("peak_bytes").is_null());
  EXPECT_TRUE(b.at("x").is_null());
  EXPECT_TRUE(b.at("y").is_null());
  EXPECT_TRUE(b.at("z").is_null());
  EXPECT_EQ(b.at("label"), "NaN");
  EXPECT_EQ(b.at("w"), 1.5);
}

// ----- memory estimates against the heap counter -----

// Variants whose memory_estimate is held to the heap counter: the counted peak of one forward
// pass beyond inputs and output (after a warm-up pass, so the OpenMP team and the libraries'
// own buffers already exist) is within a factor 2 of the estimate on every shape, and neither
// is below `floor` (what the variant must hold, e.g. full's score matrix).
struct EstimateCase {
  std::string name;
  std::vector<std::string> specs;
  struct Shape {
    int64_t b, h, n, m;
  };
  std::vector<Shape> shapes;  // d = 64
  uint64_t seed = 1;
  std::function<double(const Problem&)> floor = [](const Problem&) { return 0.0; };
};

void PrintTo(const EstimateCase& c, std::ostream* os) { *os << c.name; }

class MemoryEstimate : public testing::TestWithParam<EstimateCase> {};

TEST_P(MemoryEstimate, WithinTwiceOfMeasured) {
  ATTNBENCH_SKIP_UNDER_SANITIZER(ATTNBENCH_NO_HEAP_COUNTS);
  const EstimateCase& c = GetParam();
  for (const std::string& spec : c.specs)
    for (const EstimateCase::Shape& s : c.shapes) {
      const Problem p = test::problem(s.b, s.h, s.n, s.m, 64, false, c.seed);
      SCOPED_TRACE(spec + " " + p.str());
      auto v = make_variant(spec);
      Inputs in = generate_inputs(p);
      Tensor out(p.q_shape());
      v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());  // warm-up
      const int64_t base = heap_reset_peak();
      v->forward(p, in.q.view(), in.k.view(), in.v.view(), out.view());
      const double got = double(heap_peak_bytes() - base), est = v->memory_estimate(p);
      std::printf("[ memory ] %-50s %-20s peak %9.0f estimate %9.0f\n", spec.c_str(),
                  (std::to_string(p.n) + "x" + std::to_string(p.keys()) +
                   " BH=" + std::to_string(p.batch * p.heads))
                      .c_str(),
                  got, est);
      EXPECT_LE(got, 2 * est) << "estimate " << est << ", measured " << got;
      EXPECT_GE(got, est / 2) << "estimate " << est << ", measured " << got;
      const double floor = c.floor(p);
      EXPECT_GE(got, floor);
      EXPECT_GE(est, floor);
    }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, MemoryEstimate,
    testing::Values(
        EstimateCase{
            .name = "flash", .specs = {"flash"}, .shapes = {{1, 4, 2048, 2048}}, .seed = 3},
        EstimateCase{.name = "full",
                     .specs = {"full"},
                     .shapes = {{1, 4, 2048, 2048}},
                     .seed = 3,
                     .floor =
                         [](const Problem& p) {
                           return 4.0 * double(p.batch * p.heads * p.n * p.keys());  // the scores
                         }},
        EstimateCase{.name = "clustered",
                     .specs = {"clustered", "clustered:topk=32",
                               "clustered:clusters=64,iterations=10,bits=0,topk=0",
                               "clustered:clusters=300,iterations=10,bits=64,topk=16"},
                     .shapes = {{1, 8, 1024, 1536}, {1, 1, 3000, 5000}, {2, 3, 700, 300}}},
        EstimateCase{.name = "lowrank",
                     .specs = {"linformer", "linformer:share_kv=true,proj=64", "nystrom",
                               "nystrom:landmarks=200", "nystrom:pinv_dtype=float64", "efficient"},
                     .shapes = {{1, 8, 2048, 2048}, {1, 1, 3000, 5000}, {2, 3, 700, 300}}}),
    [](const testing::TestParamInfo<EstimateCase>& info) { return info.param.name; });

}  // namespace
}  // namespace attnbench
