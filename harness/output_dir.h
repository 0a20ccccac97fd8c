// Results directories as something that is never lost: one writer at a time (a lock), files
// written whole or not at all (a temporary file renamed over the old one, every write checked),
// and earlier results never replaced without being asked (--resume keeps them, --force moves
// them aside).
//
// The lock is DIR/.attnbench.lock, held with flock(LOCK_EX | LOCK_NB) for as long as a process
// writes DIR, and released by the kernel when that process ends however it ends (a SIGKILLed
// sweep leaves no stale lock). The file stays; it holds one line of JSON naming the holder
// ({"pid", "host", "command", "started"}), which a refused writer quotes. scripts/plot.py and the
// other scripts that write into a results directory take the same lock.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/core/error.h"

namespace attnbench {

/// A write that did not complete (a full disk, an I/O error): the message names the file and
/// the system's reason, and says the previous file was left as it was.
struct WriteError : Error {
  using Error::Error;
};

/// Writes `bytes` to `path` through a temporary file next to it, synced to the disk and renamed
/// over `path` only once every byte is written. On any failure the temporary file is removed,
/// `path` keeps its previous contents and WriteError is thrown.
void write_file_atomic(const std::string& path, std::string_view bytes);

/// Appends `line` to the file open as `fd` (results.csv) and syncs it; throws WriteError naming
/// `path` if any byte could not be written. A partial line is cut off again when possible.
void append_synced(int fd, const std::string& path, std::string_view line);

/// The lock of a results directory, held from construction to destruction.
class DirLock {
 public:
  DirLock() = default;
  /// Takes the lock of `dir` (which must exist) for `command` (the command line, quoted in the
  /// message another writer gets). Throws UsageError naming the holder if another process holds
  /// it.
  DirLock(const std::string& dir, const std::string& command);
  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// For a reader (merge reading a shard): throws UsageError naming the writer if a process holds
/// the lock of `dir` now. Creates nothing.
void require_not_being_written(const std::string& dir);

/// The command line of this process, for DirLock (set once by main).
void set_command_line(int argc, char** argv);
const std::string& command_line();

/// The result files and folders DIR holds that a new sweep would replace: results.csv with at
/// least one row, benchmark.json with at least one run, patterns/ with a file, and the side
/// files of earlier runs (meta.json, plan.json, results.malformed.csv, benchmark.json.unreadable*)
/// when any of those is there. Empty when DIR holds no results.
std::vector<std::string> held_results(const std::string& dir);

/// Moves the files held_results names into DIR/earlier-<UTC time stamp>/ (a new folder; a
/// suffix -2, -3, ... if it exists) and returns that folder.
std::string set_aside(const std::string& dir);

/// Makes `dir` ready for a writer: creates it, takes its lock and, unless `resume`, checks that
/// it holds no results. If it does: with `force` they are moved aside (set_aside) and a line on
/// stderr says where; else UsageError names what DIR holds, --resume and --force. `what` is the
/// command ("sweep", "merge") for the messages; `resume_hint` is false where --resume does not
/// apply (merge).
DirLock claim_results_dir(const std::string& dir, bool resume, bool force, const std::string& what,
                          bool resume_hint = true);

}  // namespace attnbench
