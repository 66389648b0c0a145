#include "launch/bench_plot.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"

namespace statescan::launch {
namespace {

// Distinguishable on white, in order (gnuplot's default cycle has a pale yellow).
const std::array<const char*, 8> kColors = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                            "#9467bd", "#8c564b", "#e377c2", "#17becf"};

// gnuplot single-quoted string: only ' itself needs escaping (doubled).
std::string gnuplot_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

// Runs `gnuplot script_name` in `directory`; returns its exit status, 127
// when gnuplot cannot be started.
int run_gnuplot(const std::string& directory, const std::string& script_name) {
  const pid_t pid = ::fork();
  SS_CHECK_ARG(pid >= 0, "--plot", "fork failed: ", std::strerror(errno));
  if (pid == 0) {
    if (::chdir(directory.c_str()) != 0) ::_exit(126);
    ::execlp("gnuplot", "gnuplot", script_name.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);  // exec failed: gnuplot is not installed
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    SS_CHECK_ARG(errno == EINTR, "--plot", "waitpid failed: ", std::strerror(errno));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

void plot_throughput(const std::vector<ThroughputPoint>& points, const std::string& png_path,
                     const std::string& title) {
  namespace fs = std::filesystem;
  const fs::path png = fs::absolute(png_path);
  SS_CHECK_ARG(png.extension() == ".png", "--plot", "'", png_path, "' must end in .png");
  SS_CHECK_ARG(!points.empty(), "--plot", "no rows to plot");
  const fs::path directory = png.parent_path();
  SS_CHECK_ARG(fs::is_directory(directory), "--plot", "directory '", directory.string(),
               "' does not exist");
  const std::string stem = png.stem().string();
  const std::string data_name = stem + ".dat", script_name = stem + ".gp";

  std::vector<std::string> series;
  for (const auto& p : points)
    if (std::find(series.begin(), series.end(), p.series) == series.end())
      series.push_back(p.series);

  {
    std::ofstream data(directory / data_name, std::ios::trunc);
    SS_CHECK_ARG(data.good(), "--plot", "cannot write ", (directory / data_name).string());
    data << "# T tokens_per_s, one block per series (gnuplot 'index')\n";
    for (std::size_t i = 0; i < series.size(); ++i) {
      data << (i ? "\n\n" : "") << "# " << series[i] << "\n";
      for (const auto& p : points)
        if (p.series == series[i]) data << p.seq_len << " " << p.tokens_per_s << "\n";
    }
    SS_CHECK_ARG(data.good(), "--plot", "writing ", (directory / data_name).string(), " failed");
  }
  // Ticks at the measured lengths, in binary units (8192 -> "8K").
  std::vector<int64_t> lengths;
  for (const auto& p : points) lengths.push_back(p.seq_len);
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  std::string xtics;
  for (int64_t t : lengths) {
    const std::string label = t % (1 << 20) == 0 ? std::to_string(t >> 20) + "M"
                              : t % 1024 == 0    ? std::to_string(t >> 10) + "K"
                                                 : std::to_string(t);
    xtics += (xtics.empty() ? "" : ", ") + gnuplot_quoted(label) + " " + std::to_string(t);
  }
  {
    std::ofstream script(directory / script_name, std::ios::trunc);
    SS_CHECK_ARG(script.good(), "--plot", "cannot write ", (directory / script_name).string());
    script << "# Drawn by statescan-bench --plot; run `gnuplot " << script_name
           << "` in this directory.\n"
           << "set terminal pngcairo size 960,600 font ',11'\n"
           << "set output " << gnuplot_quoted(png.filename().string()) << "\n"
           << "set title " << gnuplot_quoted(title) << " noenhanced\n"
           << "set logscale x 2\n"
           << "set xtics (" << xtics << ")\n"
           << "set format y '%.0s%c'\n"
           << "set xlabel 'sequence length T (tokens)'\n"
           << "set ylabel 'throughput (tokens/s)'\n"
           << "set xrange [" << lengths.front() / 1.4 << ":" << lengths.back() * 1.4 << "]\n"
           << "set yrange [0:*]\n"
           << "set grid\n"
           << "set key outside right top noenhanced\n"
           << "plot";
    for (std::size_t i = 0; i < series.size(); ++i) {
      script << (i ? ", \\\n    ''" : " " + gnuplot_quoted(data_name)) << " index " << i
             << " using 1:2 with linespoints lw 2 pt 7 lc rgb '" << kColors[i % kColors.size()]
             << "' title " << gnuplot_quoted(series[i]);
    }
    script << "\n";
    SS_CHECK_ARG(script.good(), "--plot", "writing ", (directory / script_name).string(),
                 " failed");
  }

  const int status = run_gnuplot(directory.string(), script_name);
  SS_CHECK_ARG(status != 127, "--plot",
               "gnuplot is not installed (apt-get install gnuplot-nox); the data and script are "
               "in ",
               (directory / script_name).string(), ": run `gnuplot ", script_name, "` in ",
               directory.string(), " where gnuplot is installed");
  SS_CHECK_ARG(status == 0, "--plot", "gnuplot ", (directory / script_name).string(),
               " failed with status ", status);
  SS_CHECK_ARG(fs::is_regular_file(png), "--plot", "gnuplot wrote no ", png.string());
}

}  // namespace statescan::launch
