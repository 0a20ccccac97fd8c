// The threads a variant runs on.
//
// The harness decides the thread count once, for every call into a variant (run_one sets
// the OpenMP team size and OpenBLAS's thread count around them); a variant, engine or kernel
// never chooses a count of its own. It opens its parallel regions with the team it is given,
// and asks team_threads() when it needs the number (a work split, a memory estimate).
#pragma once

#include <omp.h>

namespace attnbench {

/// Threads a parallel region opened by the caller gets: the team size the harness set.
inline int team_threads() { return omp_get_max_threads(); }

}  // namespace attnbench
