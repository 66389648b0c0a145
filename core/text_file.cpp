#include "core/text_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/error.h"

namespace statescan {

void write_file(const std::string& path, std::initializer_list<FileBytes> parts,
                const char* argument) {
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    SS_CHECK_ARG(out.good(), argument, "cannot open ", temp, " for writing: ", std::strerror(errno));
    for (const FileBytes& part : parts)
      if (part.size > 0)
        out.write(static_cast<const char*>(part.data), static_cast<std::streamsize>(part.size));
    out.flush();
    if (!out.good()) {
      const int saved_errno = errno;
      out.close();
      std::remove(temp.c_str());
      SS_FAIL(argument, "writing ", temp, " failed: ", std::strerror(saved_errno));
    }
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const int saved_errno = errno;
    std::remove(temp.c_str());
    SS_FAIL(argument, "cannot rename ", temp, " to ", path, ": ", std::strerror(saved_errno));
  }
}

}  // namespace statescan
