// statescan-bench --plot: the data and gnuplot script it writes, the PNG
// gnuplot draws from them, and the errors when it cannot.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/options.h"
#include "launch/bench_plot.h"

namespace statescan::test {
namespace {

namespace fs = std::filesystem;
using launch::plot_throughput;
using launch::ThroughputPoint;

bool gnuplot_installed() {
  return std::system("command -v gnuplot >/dev/null 2>&1") == 0;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class BenchPlot : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("statescan-plot-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    // Fresh random throughputs for every variant over three lengths.
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<double> tps(1e5, 1e9);
    for (Variant v : kAllVariants)
      for (int64_t t : {8192, 32768, 131072}) points_.push_back({to_string(v), t, tps(rng)});
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
  std::vector<ThroughputPoint> points_;
};

TEST_F(BenchPlot, DrawsAPngFromTheRows) {
  if (!gnuplot_installed()) GTEST_SKIP() << "gnuplot is not installed";
  plot_throughput(points_, (dir_ / "tp.png").string(), "forward, bf16");
  const std::string png = read_file(dir_ / "tp.png");
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
}

TEST_F(BenchPlot, DataFileHoldsEveryRowBySeries) {
  // Writing the data and script happens before gnuplot runs, installed or not.
  try {
    plot_throughput(points_, (dir_ / "tp.png").string(), "t");
  } catch (const Error&) {
  }
  std::ifstream data(dir_ / "tp.dat");
  std::string line, series;
  std::size_t next = 0;
  while (std::getline(data, line)) {
    if (line.empty()) continue;
    if (line.rfind("# ", 0) == 0) {
      series = line.substr(2);
      continue;
    }
    ASSERT_LT(next, points_.size());
    std::istringstream row(line);
    int64_t t = 0;
    double tps = 0;
    row >> t >> tps;
    EXPECT_EQ(series, points_[next].series);
    EXPECT_EQ(t, points_[next].seq_len);
    EXPECT_NEAR(tps, points_[next].tokens_per_s, 1e-5 * points_[next].tokens_per_s);
    ++next;
  }
  EXPECT_EQ(next, points_.size());
  const std::string script = read_file(dir_ / "tp.gp");
  EXPECT_NE(script.find("set output 'tp.png'"), std::string::npos);
  EXPECT_NE(script.find("'32K' 32768"), std::string::npos);
  EXPECT_NE(script.find("title 'kda'"), std::string::npos);
}

// The x axis names lengths in M, K or plain tokens, each at its value.
TEST_F(BenchPlot, AxisLabelsNameMebiAndKibiTokens) {
  const std::vector<ThroughputPoint> points = {
      {"kda", 1000, 1e6}, {"kda", 8192, 2e6}, {"kda", 1 << 20, 3e6}, {"kda", 3 << 20, 4e6}};
  try {
    plot_throughput(points, (dir_ / "tp.png").string(), "t");
  } catch (const Error&) {
  }
  const std::string script = read_file(dir_ / "tp.gp");
  EXPECT_NE(script.find("set xtics ('1000' 1000, '8K' 8192, '1M' 1048576, '3M' 3145728)"),
            std::string::npos)
      << script;
}

TEST_F(BenchPlot, MissingGnuplotIsAnErrorThatSaysHowToDrawLater) {
  const char* old_path = std::getenv("PATH");
  const std::string saved = old_path != nullptr ? old_path : "";
  ::setenv("PATH", dir_.c_str(), 1);  // no gnuplot in there
  try {
    plot_throughput(points_, (dir_ / "tp.png").string(), "t");
    ADD_FAILURE() << "no error without gnuplot";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "--plot");
    EXPECT_NE(std::string(e.what()).find("gnuplot is not installed"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("tp.gp"), std::string::npos) << e.what();
  }
  ::setenv("PATH", saved.c_str(), 1);
  EXPECT_TRUE(fs::exists(dir_ / "tp.gp"));
  EXPECT_FALSE(fs::exists(dir_ / "tp.png"));
}

TEST_F(BenchPlot, RefusesAnythingButPng) {
  try {
    plot_throughput(points_, (dir_ / "tp.svg").string(), "t");
    ADD_FAILURE() << "no error for .svg";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "--plot");
  }
  try {
    plot_throughput({}, (dir_ / "tp.png").string(), "t");
    ADD_FAILURE() << "no error for no rows";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "--plot");
  }
}

}  // namespace
}  // namespace statescan::test
