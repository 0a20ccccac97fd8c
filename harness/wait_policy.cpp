// The OpenMP wait policy of the attnbench binary and the tests: passive unless the user chose.
//
// A thread of an OpenMP team that waits (at a barrier, or for the next region) spins before it
// sleeps; libgomp's default spin, GOMP_SPINCOUNT's 300000 iterations of a pause instruction,
// lasts milliseconds on CPUs whose pause takes ~100 cycles (Skylake and later, Sapphire
// Rapids among them). A thread that spins never leaves its core, so when another process is
// busy beside the team, the team member the scheduler preempted waits for the spinner's time
// slice to end: every region costs a scheduler slice, not microseconds. A passive wait (the
// waiting thread sleeps on a futex at once) lets its core go idle, where the scheduler runs
// the preempted thread at once; a region then costs a futex wake-up (microseconds) more than
// with spinning, nothing on regions of the size the team is used for (common/core/parallel.h,
// kParallelMinFlops), and small ones run on one thread.
//
// libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, in a constructor of libgomp.so that
// runs before main(), so the choice is made earlier still: from .preinit_array, which the
// dynamic loader runs before the constructors of every shared library. A user's
// OMP_WAIT_POLICY or GOMP_SPINCOUNT, either one, is left as it is. (The Python module cannot
// do this: a module is a shared library, loaded after libgomp may already be running.)
#include <cstdlib>

namespace {

void choose_wait_policy(int, char**, char**) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  setenv("OMP_WAIT_POLICY", "passive", 0);
}

// Runs before libgomp's initialisation; in the executable, the only place it is allowed.
[[gnu::section(".preinit_array"),
  gnu::used]] void (*preinit_wait_policy)(int, char**, char**) = &choose_wait_policy;

}  // namespace
