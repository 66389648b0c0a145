#include "core/text_file.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "core/error.h"

namespace statescan {

void write_text_file(const std::string& path, const std::string& text, const char* argument) {
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temp, std::ios::trunc);
    SS_CHECK_ARG(out.good(), argument, "cannot open ", temp, " for writing");
    out << text;
    out.flush();
    if (!out.good()) {
      out.close();
      std::remove(temp.c_str());
      SS_FAIL(argument, "writing ", temp, " failed");
    }
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    SS_FAIL(argument, "cannot rename ", temp, " to ", path);
  }
}

}  // namespace statescan
