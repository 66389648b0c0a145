#include "core/env_knob.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/cli_parse.h"
#include "core/error.h"

namespace statescan {

int env_choice(const char* name, std::initializer_list<const char*> allowed) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return -1;
  int index = 0;
  std::string choices;
  for (const char* value : allowed) {
    if (std::strcmp(text, value) == 0) return index;
    choices += (index == 0 ? "'" : ", '") + std::string(value) + "'";
    ++index;
  }
  SS_FAIL(name, "must be one of ", choices, " (or unset), got '", text, "'");
}

int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  return parse_int(text, name, lo, hi);
}

}  // namespace statescan
