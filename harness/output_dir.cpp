#include "harness/output_dir.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "harness/machine.h"

namespace fs = std::filesystem;

namespace attnbench {

namespace {

std::string& command_line_text() {
  static std::string text = "attnbench";
  return text;
}

// Writes every byte of `bytes` to `fd`; false (errno set) on the first failure.
bool write_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t w = ::write(fd, bytes.data(), bytes.size());
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (w == 0) {
      errno = EIO;
      return false;
    }
    bytes.remove_prefix(size_t(w));
  }
  return true;
}

// The files and folders of a sweep's results (besides the plots and reports the scripts make).
const char* const kResultFiles[] = {"results.csv", "benchmark.json", "meta.json",
                                    "plan.json",   "patterns",       "results.malformed.csv"};

bool csv_has_rows(const fs::path& path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return false;  // empty
  while (std::getline(in, line))
    if (!line.empty()) return true;
  return false;
}

bool json_has_runs(const fs::path& path) {
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  // unreadable JSON counts as results: it may be the only record of something
  if (!j.is_object()) return fs::file_size(path) > 0;
  return j.contains("benchmarks") && j["benchmarks"].is_array() && !j["benchmarks"].empty();
}

}  // namespace

void set_command_line(int argc, char** argv) {
  std::string text;
  for (int i = 0; i < argc; ++i) {
    if (i > 0) text += ' ';
    text += argv[i];
  }
  command_line_text() = text;
}

const std::string& command_line() { return command_line_text(); }

void write_file_atomic(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw WriteError(fmt::format("cannot write '{}': {}; '{}' is left as it was", tmp,
                                 std::strerror(errno), path));
  bool ok = write_all(fd, bytes) && ::fsync(fd) == 0;
  int err = errno;
  if (::close(fd) != 0 && ok) ok = false, err = errno;
  if (ok && ::rename(tmp.c_str(), path.c_str()) != 0) ok = false, err = errno;
  if (!ok) {
    ::unlink(tmp.c_str());
    throw WriteError(fmt::format("cannot write '{}': {}; the previous file is left as it was", path,
                                 std::strerror(err)));
  }
}

void append_synced(int fd, const std::string& path, std::string_view line) {
  const off_t before = ::lseek(fd, 0, SEEK_END);
  if (write_all(fd, line) && ::fdatasync(fd) == 0) return;
  const int err = errno;
  // cut a partial line off again, so the file ends with a whole row
  if (before >= 0 && ::ftruncate(fd, before) == 0) ::fdatasync(fd);
  throw WriteError(fmt::format("cannot append to '{}': {}; the rows before this one are kept", path,
                               std::strerror(err)));
}

namespace {

// The error for a lock of `dir` held by another process: the holder as its record names it.
UsageError held_by_another(const std::string& dir, const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto j = nlohmann::json::parse(text, nullptr, false);
  std::string holder = "an unknown process";
  if (j.is_object()) {
    auto get = [&](const char* key) {
      if (!j.contains(key)) return std::string("?");
      return j[key].is_string() ? j[key].get<std::string>() : j[key].dump();
    };
    holder = fmt::format("pid {} on {}, started {}: {}", get("pid"), get("host"), get("started"),
                         get("command"));
  }
  return UsageError(
      fmt::format("results directory '{}' is being written by another process ({}); wait for "
                  "it to finish or write elsewhere",
                  dir, holder));
}

}  // namespace

void require_not_being_written(const std::string& dir) {
  const std::string path = (fs::path(dir) / ".attnbench.lock").string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // never written by a process that locks
  const bool free = ::flock(fd, LOCK_SH | LOCK_NB) == 0 || errno != EWOULDBLOCK;
  ::close(fd);
  if (!free) throw held_by_another(dir, path);
}

DirLock::DirLock(const std::string& dir, const std::string& command) {
  const std::string path = (fs::path(dir) / ".attnbench.lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw UsageError(fmt::format("cannot write into results directory '{}': cannot open '{}': {}",
                                 dir, path, std::strerror(errno)));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK) throw held_by_another(dir, path);
    throw UsageError(
        fmt::format("cannot lock results directory '{}' ({}): {}", dir, path, std::strerror(err)));
  }
  const nlohmann::json who = {{"pid", int64_t(::getpid())},
                              {"host", host_name()},
                              {"command", command},
                              {"started", utc_now()}};
  const std::string line = who.dump() + '\n';
  // the record is informative only: the lock is the flock, so a failed write is not fatal
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] const bool written = ::lseek(fd_, 0, SEEK_SET) == 0 && write_all(fd_, line);
  }
}

DirLock::DirLock(DirLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }

DirLock& DirLock::operator=(DirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the flock; the file stays (see the header)
}

std::vector<std::string> held_results(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec)) return {};
  // what was measured: rows, Google Benchmark runs, stored patterns, a set-aside benchmark.json
  std::vector<std::string> unreadable;
  for (const auto& e : fs::directory_iterator(d, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("benchmark.json.unreadable", 0) == 0) unreadable.push_back(name);
  }
  bool patterns = false;
  for (const auto& e : fs::directory_iterator(d / "patterns", ec))
    patterns |= e.path().extension() == ".npy";
  const bool measured =
      patterns || !unreadable.empty() ||
      (fs::is_regular_file(d / "results.csv", ec) && csv_has_rows(d / "results.csv")) ||
      (fs::is_regular_file(d / "benchmark.json", ec) && json_has_runs(d / "benchmark.json"));
  if (!measured) return {};
  // then every result file goes with them
  std::vector<std::string> held;
  for (const char* name : kResultFiles)
    if (fs::exists(d / name, ec)) held.push_back(name);
  held.insert(held.end(), unreadable.begin(), unreadable.end());
  return held;
}

std::string set_aside(const std::string& dir) {
  const auto held = held_results(dir);
  char stamp[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", std::gmtime(&t));
  fs::path aside = fs::path(dir) / fmt::format("earlier-{}", stamp);
  for (int i = 2; fs::exists(aside); ++i)
    aside = fs::path(dir) / fmt::format("earlier-{}-{}", stamp, i);
  std::error_code ec;
  fs::create_directory(aside, ec);
  if (ec)
    throw WriteError(fmt::format("cannot create '{}' to move earlier results into: {}",
                                 aside.string(), ec.message()));
  for (const auto& name : held) {
    fs::rename(fs::path(dir) / name, aside / name, ec);
    if (ec)
      throw WriteError(fmt::format("cannot move '{}' into '{}': {}",
                                   (fs::path(dir) / name).string(), aside.string(), ec.message()));
  }
  return aside.string();
}

DirLock claim_results_dir(const std::string& dir, bool resume, bool force, const std::string& what,
                          bool resume_hint) {
  if (dir.empty()) throw UsageError("--out is empty; give a results directory: --out DIR");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw UsageError(fmt::format("cannot create results directory '{}': {}", dir,
                                 ec ? ec.message() : "a file of that name exists"));
  DirLock lock(dir, command_line());
  if (resume) return lock;
  const auto held = held_results(dir);
  if (held.empty()) return lock;
  std::string list;
  for (const auto& h : held) list += (list.empty() ? "" : ", ") + h;
  if (!force)
    throw UsageError(fmt::format(
        "results directory '{}' already holds results ({}); {}--force moves them aside into "
        "'{}/earlier-<time>/' first, or choose another directory",
        dir, list,
        resume_hint ? "--resume keeps them and runs only the missing configurations; " : "", dir));
  const std::string aside = set_aside(dir);
  fmt::print(stderr, "attnbench: {}: --force: the earlier results ({}) are moved to '{}'\n", what,
             list, aside);
  return lock;
}

}  // namespace attnbench
