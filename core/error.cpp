#include "core/error.h"

#include <atomic>

namespace statescan {
namespace {
std::atomic<int> g_rank{-1};

std::string format(const std::string& argument, const std::string& message, int rank,
                   const char* file, int line) {
  std::ostringstream os;
  os << "statescan error [rank ";
  if (rank >= 0) {
    os << rank;
  } else {
    os << "?";
  }
  os << "]";
  if (!argument.empty()) os << " argument '" << argument << "'";
  os << ": " << message;
  if (file != nullptr) os << " (" << file << ":" << line << ")";
  return os.str();
}
}  // namespace

void set_error_rank(int rank) { g_rank.store(rank); }
int error_rank() { return g_rank.load(); }

Error::Error(std::string argument, const std::string& message, const char* file, int line)
    : std::runtime_error(format(argument, message, g_rank.load(), file, line)),
      argument_(std::move(argument)),
      message_(message),
      rank_(g_rank.load()) {}

Error::Error(std::string argument, const std::string& what_text, int rank)
    : std::runtime_error(what_text),
      argument_(std::move(argument)),
      message_(what_text),
      rank_(rank) {}

}  // namespace statescan
