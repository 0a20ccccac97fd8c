// Exception types. Every message says what was wrong and what is accepted.
#pragma once

#include <stdexcept>
#include <string>

namespace attnbench {

/// Base of all attnbench errors.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// A malformed or invalid variant spec string or parameter value.
struct SpecError : Error {
  using Error::Error;
};
/// A variant asked for something it does not support (causal, m != n, ...).
struct UnsupportedError : Error {
  using Error::Error;
};
/// Bad input data: wrong shape or dtype, truncated file, NaN/Inf.
struct InputError : Error {
  using Error::Error;
};
/// A bad command-line value.
struct UsageError : Error {
  using Error::Error;
};

}  // namespace attnbench
