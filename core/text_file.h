// Whole-file writes for the tools' results (JSON reports): written to a
// temporary file beside the target and renamed over it once complete, so a
// reader never sees half a file and a failed write leaves the old one.
#pragma once

#include <string>

namespace statescan {

// Writes `text` to `path`; throws statescan::Error naming `argument` (the flag
// that gave the path) if it cannot be written completely.
void write_text_file(const std::string& path, const std::string& text, const char* argument);

}  // namespace statescan
