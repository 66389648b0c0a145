// NumPy .npy reader/writer. Format (numpy.lib.format): the magic "\x93NUMPY",
// a major/minor version byte pair, the header length (uint16 in 1.0, uint32 in
// 2.0/3.0, little-endian), then a Python dict literal
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// padded with spaces and ended by '\n', then the raw C-order data.
#include "core/npy.h"


#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/text_file.h"

namespace statescan {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicSize = 6;
// Writers align the start of the data to this many bytes (numpy uses 64 so
// that memory-mapped arrays are aligned for any vector load).
constexpr std::size_t kHeaderAlignment = 64;
// int64 values beyond this magnitude would not survive the conversion to double.
constexpr int64_t kMaxExactInteger = int64_t{1} << 53;

// A minimal cursor over the header dict. The header is written by numpy's
// repr(), so we accept exactly its grammar: quoted keys, a quoted descr
// string, True/False and a tuple of non-negative integers.
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& path) : text_(text), path_(path) {}

  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool consume(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) fail(std::string("expected '") + c + "'");
  }
  std::string quoted() {
    skip_space();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"'))
      fail("expected a quoted string");
    const char quote = text_[pos_++];
    const std::size_t end = text_.find(quote, pos_);
    if (end == std::string::npos) fail("unterminated string");
    std::string s = text_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }
  bool boolean() {
    skip_space();
    if (text_.compare(pos_, 4, "True") == 0) {
      pos_ += 4;
      return true;
    }
    if (text_.compare(pos_, 5, "False") == 0) {
      pos_ += 5;
      return false;
    }
    fail("expected True or False");
  }
  Shape tuple() {
    expect('(');
    Shape shape;
    while (!consume(')')) {
      skip_space();
      const std::size_t start = pos_;
      int64_t value = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        if (value > (std::numeric_limits<int64_t>::max() - 9) / 10) fail("dimension too large");
        value = value * 10 + (text_[pos_++] - '0');
      }
      if (pos_ == start) fail("expected a non-negative integer dimension");
      shape.push_back(value);
      if (!consume(',')) {
        expect(')');
        break;
      }
    }
    return shape;
  }
  [[noreturn]] void fail(const std::string& what) const {
    SS_FAIL(path_, "malformed .npy header in ", path_, ": ", what, " at offset ", pos_, " of \"",
            text_, "\"");
  }

 private:
  const std::string& text_;
  const std::string& path_;
  std::size_t pos_ = 0;
};

struct Header {
  std::string descr;
  bool fortran_order = false;
  Shape shape;
};

Header parse_header(const std::string& text, const std::string& path) {
  HeaderParser parser(text, path);
  Header h;
  bool have_descr = false, have_order = false, have_shape = false;
  parser.expect('{');
  while (!parser.consume('}')) {
    const std::string key = parser.quoted();
    parser.expect(':');
    if (key == "descr") {
      h.descr = parser.quoted();
      have_descr = true;
    } else if (key == "fortran_order") {
      h.fortran_order = parser.boolean();
      have_order = true;
    } else if (key == "shape") {
      h.shape = parser.tuple();
      have_shape = true;
    } else {
      parser.fail("unexpected key '" + key + "'");
    }
    if (!parser.consume(',')) {
      parser.expect('}');
      break;
    }
  }
  if (!have_descr || !have_order || !have_shape)
    parser.fail("the header needs the keys 'descr', 'fortran_order' and 'shape'");
  return h;
}

uint32_t read_le(const unsigned char* bytes, int count) {
  uint32_t v = 0;
  for (int i = count - 1; i >= 0; --i) v = (v << 8) | bytes[i];
  return v;
}

// Element size of a supported descr; throws naming the file otherwise.
std::size_t element_size(const std::string& descr, const std::string& path) {
  if (descr == "<f4") return 4;
  if (descr == "<f8" || descr == "<i8") return 8;
  SS_CHECK_ARG(descr.empty() || descr[0] != '>', path, path, ": big-endian dtype '", descr,
               "' is not supported (convert with arr.astype(arr.dtype.newbyteorder('<')))");
  SS_FAIL(path, path, ": dtype '", descr, "' is not supported (expected float32 '<f4', ",
          "float64 '<f8' or int64 '<i8')");
}

std::string shape_literal(const Shape& shape) {
  std::ostringstream os;
  os << "(";
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) os << ",";
  os << ")";
  return os.str();
}

// Writes header + data to a temporary file in the target's directory, then
// renames it over `path` (atomic on POSIX), so readers never see a partial file.
void write_array(const std::string& path, const Shape& shape, const char* descr, const void* data,
                 std::size_t element_bytes) {
  for (int64_t extent : shape)
    SS_CHECK_ARG(extent >= 0, path, "cannot write ", path, ": negative extent in shape ",
                 shape_string(shape));
  std::string dict = std::string("{'descr': '") + descr +
                     "', 'fortran_order': False, 'shape': " + shape_literal(shape) + ", }";
  // Version 1.0 stores the header length in 16 bits; 2.0 only widens it.
  const bool v2 = dict.size() + 1 + kMagicSize + 4 > 65535;
  const std::size_t prefix = kMagicSize + 2 + (v2 ? 4 : 2);
  const std::size_t unpadded = prefix + dict.size() + 1;
  const std::size_t padding = (kHeaderAlignment - unpadded % kHeaderAlignment) % kHeaderAlignment;
  dict.append(padding, ' ');
  dict.push_back('\n');

  std::string head(kMagic, kMagicSize);
  head.push_back(static_cast<char>(v2 ? 2 : 1));
  head.push_back(0);
  const std::size_t header_len = dict.size();
  for (int i = 0; i < (v2 ? 4 : 2); ++i)
    head.push_back(static_cast<char>((header_len >> (8 * i)) & 0xffu));
  head += dict;

  const std::size_t data_bytes = static_cast<std::size_t>(numel(shape)) * element_bytes;
  write_file(path, {{head.data(), head.size()}, {data, data_bytes}}, path.c_str());
}

}  // namespace

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SS_CHECK_ARG(in.good(), path, "cannot open ", path, ": ", std::strerror(errno));

  unsigned char prefix[kMagicSize + 2];
  in.read(reinterpret_cast<char*>(prefix), sizeof prefix);
  SS_CHECK_ARG(in.gcount() == static_cast<std::streamsize>(sizeof prefix) &&
                   std::memcmp(prefix, kMagic, kMagicSize) == 0,
               path, path, " is not a .npy file (bad magic)");
  const int major = prefix[kMagicSize];
  SS_CHECK_ARG(major >= 1 && major <= 3, path, path, ": unsupported .npy format version ", major,
               ".", static_cast<int>(prefix[kMagicSize + 1]));

  const int len_bytes = major == 1 ? 2 : 4;
  unsigned char len_raw[4];
  in.read(reinterpret_cast<char*>(len_raw), len_bytes);
  SS_CHECK_ARG(in.gcount() == len_bytes, path, path, ": truncated header");
  const uint32_t header_len = read_le(len_raw, len_bytes);
  SS_CHECK_ARG(header_len <= (1u << 24), path, path, ": header length ", header_len,
               " is implausible");
  std::string header_text(header_len, '\0');
  in.read(header_text.data(), header_len);
  SS_CHECK_ARG(in.gcount() == static_cast<std::streamsize>(header_len), path, path,
               ": truncated header");

  const Header header = parse_header(header_text, path);
  SS_CHECK_ARG(!header.fortran_order, path, path,
               ": fortran_order True is not supported (save a C-contiguous array, "
               "e.g. np.ascontiguousarray)");
  const std::size_t elem = element_size(header.descr, path);

  NpyArray array;
  array.shape = header.shape;
  array.descr = header.descr;
  // Check the declared size against the file before allocating, so that a
  // corrupt shape cannot ask for terabytes.
  std::error_code ec;
  const auto file_bytes = std::filesystem::file_size(path, ec);
  const std::size_t data_offset = kMagicSize + 2 + static_cast<std::size_t>(len_bytes) + header_len;
  const std::size_t available = ec || file_bytes < data_offset ? 0 : file_bytes - data_offset;
  int64_t count = 1;
  for (int64_t extent : header.shape) {
    SS_CHECK_ARG(extent == 0 || count <= static_cast<int64_t>(available / elem) / extent, path,
                 path, ": truncated data (shape ", shape_string(header.shape),
                 " needs more than the ", available, " bytes present)");
    count *= extent;
  }
  std::vector<char> raw(static_cast<std::size_t>(count) * elem);
  in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
  SS_CHECK_ARG(in.gcount() == static_cast<std::streamsize>(raw.size()), path, path,
               ": truncated data (shape ", shape_string(header.shape), " needs ", raw.size(),
               " bytes, found ", in.gcount(), ")");

  // Byte-wise copies: the data need not be aligned, and this is a
  // little-endian host (static_assert below keeps it honest).
  array.data.resize(static_cast<std::size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const char* src = raw.data() + static_cast<std::size_t>(i) * elem;
    if (header.descr == "<f4") {
      float f;
      std::memcpy(&f, src, 4);
      array.data[static_cast<std::size_t>(i)] = f;
    } else if (header.descr == "<f8") {
      std::memcpy(&array.data[static_cast<std::size_t>(i)], src, 8);
    } else {
      int64_t n;
      std::memcpy(&n, src, 8);
      // Compare as integers: 2^53 + 1 would already round to 2^53 as a double.
      SS_CHECK_ARG(n <= kMaxExactInteger && n >= -kMaxExactInteger, path, path, ": int64 element ",
                   i, " = ", n, " exceeds 2^53 and cannot be represented exactly");
      array.data[static_cast<std::size_t>(i)] = static_cast<double>(n);
    }
  }
  return array;
}

bool npy_exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

void write_npy(const std::string& path, const Shape& shape, const float* data) {
  write_array(path, shape, "<f4", data, sizeof(float));
}

void write_npy(const std::string& path, const Shape& shape, const double* data) {
  write_array(path, shape, "<f8", data, sizeof(double));
}

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "npy.cpp copies little-endian data directly; add byte swapping for this host");
#endif

}  // namespace statescan
