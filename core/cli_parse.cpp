#include "core/cli_parse.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>
#include <system_error>

#include "core/error.h"

namespace statescan {

int64_t parse_int(std::string_view text, const char* flag, int64_t min, int64_t max) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  SS_CHECK_ARG(ec == std::errc() && end == text.data() + text.size(), flag,
               "expects an integer, got '", std::string(text), "'");
  SS_CHECK_ARG(value >= min && value <= max, flag, "must be in [", min, ", ", max, "], got ",
               value);
  return value;
}

double parse_number(std::string_view text, const char* flag) {
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(s.c_str(), &end);
  SS_CHECK_ARG(!s.empty() && end == s.c_str() + s.size() && errno == 0 && std::isfinite(value),
               flag, "expects a finite number, got '", s, "'");
  return value;
}

double parse_positive_number(std::string_view text, const char* flag) {
  const double value = parse_number(text, flag);
  SS_CHECK_ARG(value > 0, flag, "must be a number > 0, got '", std::string(text), "'");
  return value;
}

}  // namespace statescan
