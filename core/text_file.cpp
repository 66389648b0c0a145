#include "core/text_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace statescan {

void write_file(const std::string& path, std::initializer_list<FileBytes> parts,
                const char* argument) {
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  // POSIX calls rather than a stream: every step's result is checked, the
  // close's included (NFS and Lustre report a full quota or disk there, and
  // an unchecked close renamed a truncated file over the old one), and the
  // data reaches the disk (fsync) before the rename makes it the file.
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  SS_CHECK_ARG(fd >= 0, argument, "cannot open ", temp, " for writing: ", std::strerror(errno));
  const auto fail = [&](const char* what, bool close_it) {
    const int saved_errno = errno;
    if (close_it) (void)::close(fd);
    (void)std::remove(temp.c_str());
    SS_FAIL(argument, what, " ", temp, " failed: ", std::strerror(saved_errno));
  };
  for (const FileBytes& part : parts) {
    const char* at = static_cast<const char*>(part.data);
    std::size_t left = part.size;
    while (left > 0) {
      const ssize_t n = ::write(fd, at, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (n == 0) errno = EIO;
        fail("writing", true);
      }
      at += n;
      left -= static_cast<std::size_t>(n);
    }
  }
  // Some file systems (FUSE, 9p) cannot sync at all: that is not a failed
  // write. EIO, ENOSPC, EDQUOT and the rest are.
  if (::fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP && errno != EOPNOTSUPP &&
      errno != ENOSYS)
    fail("syncing", true);
  if (::close(fd) != 0) fail("closing", false);
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const int saved_errno = errno;
    (void)std::remove(temp.c_str());
    SS_FAIL(argument, "cannot rename ", temp, " to ", path, ": ", std::strerror(saved_errno));
  }
}

std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", x);
  return text;
}

}  // namespace statescan
