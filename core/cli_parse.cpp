#include "core/cli_parse.h"

#include <cctype>
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
  // strtod also takes leading blanks and hexadecimal ("0x10", "0x1p4"): not
  // decimal numbers. It reports a subnormal result (1e-310) as ERANGE too,
  // which is a number all the same; an underflow to 0 or overflow is not.
  const bool decimal = !s.empty() && std::isspace(static_cast<unsigned char>(s[0])) == 0 &&
                       s.find_first_of("xX") == std::string::npos;
  const bool in_range = errno == 0 || (errno == ERANGE && value != 0 && std::isfinite(value));
  SS_CHECK_ARG(decimal && end == s.c_str() + s.size() && in_range && std::isfinite(value), flag,
               "expects a finite decimal number, got '", s, "'");
  return value;
}

double parse_positive_number(std::string_view text, const char* flag) {
  const double value = parse_number(text, flag);
  SS_CHECK_ARG(value > 0, flag, "must be a number > 0, got '", std::string(text), "'");
  return value;
}

void check_tensor_elements(std::initializer_list<NamedExtent> extents, const char* flag) {
  long double elements = 1;
  std::string product;
  for (const NamedExtent& e : extents) {
    elements *= static_cast<long double>(e.value);
    product += (product.empty() ? "" : " x ") + std::string(e.name) + " " + std::to_string(e.value);
  }
  constexpr long double kMaxElements = static_cast<long double>(int64_t{1} << 48);
  SS_CHECK_ARG(elements <= kMaxElements, flag, product, " = ", elements,
               " elements per tensor, more than 2^48");
}

}  // namespace statescan
