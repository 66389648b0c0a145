// Throughput against sequence length, drawn by gnuplot (Debian package
// gnuplot-nox), for `statescan-bench --plot FILE.png`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace statescan::launch {

struct ThroughputPoint {
  std::string series;  // one line per series, e.g. the variant
  int64_t seq_len = 0;
  double tokens_per_s = 0;
};

// Writes the data (FILE.dat, one block per series in first-seen order) and a
// gnuplot script (FILE.gp) next to `png_path` (FILE.png), then runs gnuplot
// on the script to draw FILE.png: tokens/s against T, log2 x axis, one line
// per series. The script names its files relative to its own directory, so
// the .gp/.dat pair can be drawn on another machine. Throws statescan::Error
// naming "--plot" when png_path does not end in .png, a file cannot be
// written, or gnuplot is missing or fails (the message says how to draw the
// script where gnuplot is installed).
void plot_throughput(const std::vector<ThroughputPoint>& points, const std::string& png_path,
                     const std::string& title);

}  // namespace statescan::launch
