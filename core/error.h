// statescan::Error — the one exception type of the library.
//
// Every message names the argument at fault, the rank that saw it and the
// file:line that threw, so that a failure in a 1000-rank job can be traced from
// any one rank's log. Library code throws; only launch/ mains turn errors into
// exit codes.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace statescan {

// The rank printed in error messages. Communicators set it when they are
// created; it stays -1 (printed as "?") in single-process use.
void set_error_rank(int rank);
int error_rank();

class Error : public std::runtime_error {
 public:
  Error(std::string argument, const std::string& message, const char* file, int line);
  // Rebuilds an error that another rank raised (see comm/collective_check.h).
  Error(std::string argument, const std::string& what_text, int rank);

  const std::string& argument() const { return argument_; }
  int rank() const { return rank_; }
  // The message alone, without what()'s prefix (rank, argument) and source
  // location: for a caller that wraps it in an error of its own. An error
  // rebuilt from another rank's text has only that text.
  const std::string& message() const { return message_; }

  // Whether every peer of the group already knows of this failure: an error
  // that collective_check raised alike on every rank, or one that reports a
  // peer's fault notice (Communicator::notify_failure). A layer that tells its
  // peers when its call fails on this rank alone skips these.
  bool peers_know() const { return peers_know_; }
  Error& mark_peers_know() {
    peers_know_ = true;
    return *this;
  }

 private:
  std::string argument_;
  std::string message_;
  int rank_;
  bool peers_know_ = false;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

}  // namespace statescan

// Throws statescan::Error naming argument `arg` unless `cond` holds. The
// remaining arguments are streamed into the message.
#define SS_CHECK_ARG(cond, arg, ...)                                                         \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      throw ::statescan::Error((arg), ::statescan::detail::concat(__VA_ARGS__), __FILE__,   \
                               __LINE__);                                                   \
    }                                                                                       \
  } while (0)

#define SS_FAIL(arg, ...) \
  throw ::statescan::Error((arg), ::statescan::detail::concat(__VA_ARGS__), __FILE__, __LINE__)
