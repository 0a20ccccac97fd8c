// `attnbench merge`: the results directories of a sharded sweep (`sweep --shard i/N`) made into
// one, as the unsharded sweep would have written it.
#pragma once

#include <string>
#include <vector>

namespace attnbench {

struct MergeOptions {
  std::vector<std::string> dirs;  ///< the shards' results directories
  std::string out;                ///< the merged directory (not one of `dirs`)
  bool strict = false;            ///< refuse shards measured on different CPU models
  bool allow_missing = false;     ///< merge even when planned configurations have no row
  bool force = false;             ///< move results already in `out` aside (else refused)
};

/// Merges the shards into opt.out: results.csv (rows in plan order, header once),
/// benchmark.json (one context, the shards' benchmarks in shard order), meta.json (the fields
/// the shards share, `shards` with each shard's summary, `hosts`), plan.json and patterns/
/// (the shards' stored patterns, index.csv merged). Throws UsageError, before writing
/// anything, for a directory without results.csv or meta.json, a shard being written by a
/// sweep now, a line no sweep writes (malformed_reason), shards of different git commits or
/// sweep definitions, an --out that is one of the inputs or holds results (unless `force`, which
/// moves them aside), a configuration with different rows in two shards, planned
/// configurations no shard has (unless allow_missing; they are named), and with `strict`
/// different CPU models (else a warning). A shard without benchmark.json, and a pattern file
/// that is not whole, are left out with a warning. Every file is written whole or not at all
/// (WriteError). Returns the rows written.
size_t merge_results(const MergeOptions& opt);

}  // namespace attnbench
