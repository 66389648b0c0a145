// Whole-file writes for the tools' results (JSON reports, .npy arrays):
// written to a temporary file beside the target and renamed over it once
// complete, so a reader never sees half a file and a failed write leaves the
// old one.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>

namespace statescan {

// A byte range to write.
struct FileBytes {
  const void* data;
  std::size_t size;
};

// Writes `parts` one after the other to `path`; throws statescan::Error
// naming `argument` (the flag, or the file, the path came from) if it cannot
// be written completely.
void write_file(const std::string& path, std::initializer_list<FileBytes> parts,
                const char* argument);

inline void write_text_file(const std::string& path, const std::string& text,
                            const char* argument) {
  write_file(path, {{text.data(), text.size()}}, argument);
}

// A JSON number: %.9g, or null for inf and NaN, which JSON cannot hold (a
// report must stay readable exactly when a kernel went wrong).
std::string json_number(double x);

}  // namespace statescan
