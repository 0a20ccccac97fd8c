// The allocation hook: defines malloc, free, calloc, realloc and the aligned allocators in
// the executable, which takes precedence over glibc's, and forwards to glibc's own entry
// points (__libc_malloc, ...). Every live block is counted by its usable size.
#include <malloc.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>

extern "C" {
void* __libc_malloc(size_t);
void __libc_free(void*);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
void* __libc_valloc(size_t);
void* __libc_pvalloc(size_t);
}

namespace attnbench::hook {

std::atomic<int64_t> g_current{0}, g_peak{0}, g_allocs{0};

inline void on_alloc(void* p) {
  if (!p) return;
  int64_t now = g_current.fetch_add(int64_t(malloc_usable_size(p)), std::memory_order_relaxed) +
                int64_t(malloc_usable_size(p));
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}
inline void on_free(void* p) {
  if (p) g_current.fetch_sub(int64_t(malloc_usable_size(p)), std::memory_order_relaxed);
}

}  // namespace attnbench::hook

using namespace attnbench::hook;

// AddressSanitizer brings its own malloc; under it the hook steps aside (and counts nothing).
#if defined(__SANITIZE_ADDRESS__)
#define ATTNBENCH_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTNBENCH_UNDER_ASAN 1
#endif
#endif

namespace attnbench {
#ifdef ATTNBENCH_UNDER_ASAN
bool heap_counting() { return false; }
#else
bool heap_counting() { return true; }
#endif
}  // namespace attnbench

#ifndef ATTNBENCH_UNDER_ASAN
extern "C" {

void* malloc(size_t size) {
  void* p = __libc_malloc(size);
  on_alloc(p);
  return p;
}
void free(void* p) {
  on_free(p);
  __libc_free(p);
}
void* calloc(size_t n, size_t size) {
  void* p = __libc_calloc(n, size);
  on_alloc(p);
  return p;
}
void* realloc(void* old, size_t size) {
  int64_t before = old ? int64_t(malloc_usable_size(old)) : 0;
  void* p = __libc_realloc(old, size);
  if (p) {
    g_current.fetch_sub(before, std::memory_order_relaxed);
    on_alloc(p);
  } else if (size == 0 && old) {
    g_current.fetch_sub(before, std::memory_order_relaxed);  // realloc(p, 0) freed p
  }
  return p;
}
void* memalign(size_t align, size_t size) {
  void* p = __libc_memalign(align, size);
  on_alloc(p);
  return p;
}
void* aligned_alloc(size_t align, size_t size) {
  void* p = __libc_memalign(align, size);
  on_alloc(p);
  return p;
}
int posix_memalign(void** out, size_t align, size_t size) {
  if (align < sizeof(void*) || (align & (align - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(align, size);
  if (!p) return ENOMEM;
  on_alloc(p);
  *out = p;
  return 0;
}
void* valloc(size_t size) {
  void* p = __libc_valloc(size);
  on_alloc(p);
  return p;
}
void* pvalloc(size_t size) {
  void* p = __libc_pvalloc(size);
  on_alloc(p);
  return p;
}

}  // extern "C"
#endif  // ATTNBENCH_UNDER_ASAN
