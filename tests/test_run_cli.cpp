// End-to-end test of statescan-run: write inputs as .npy, run the binary under
// `mpirun -np 3`, read its --save outputs back and compare them with the fp64
// reference (kernels/cpu/reference.h, and kernels/cpu/lact.h's double
// instantiation for --variant lact) on the same float32 values.
//
// T = 45 is a multiple of neither the chunk (16) nor the rank count (3), so
// shard boundaries fall inside chunks. LaCT (T = 48, chunk 12) splits every
// chunk over the 3 ranks, so each rank holds 4 tokens of each of the 4 chunks.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "core/npy.h"
#include "kernels/cpu/lact.h"
#include "kernels/cpu/reference.h"
#include "tests/lact_test_util.h"
#include "tests/test_util.h"

#ifdef STATESCAN_HAS_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_mixer.h"
#endif

#ifndef STATESCAN_RUN_PATH
#error "STATESCAN_RUN_PATH must name the statescan-run binary (set by tests/CMakeLists.txt)"
#endif
#ifndef STATESCAN_MPIEXEC
#error "STATESCAN_MPIEXEC must name mpirun (set by tests/CMakeLists.txt)"
#endif

namespace statescan {
namespace {

namespace fs = std::filesystem;
using test::rel_rms;

}  // namespace

// Print parameters by name in test listings (ctest names carry the printed
// parameter). In namespace statescan so that argument-dependent lookup finds them.
static void PrintTo(Variant v, std::ostream* os) {
  *os << to_string(v);
}
static void PrintTo(Exchange e, std::ostream* os) {
  *os << to_string(e);
}

namespace {

constexpr int kRanks = 3;
constexpr int64_t kSeqLen = 45, kHeads = 2, kDk = 8, kDv = 8, kChunk = 16;
// Both sides see the same float32 inputs; the CP run computes in fp32:
// DESIGN §7's fp32 bar (the CLI cases measure ~2e-6 at most).
constexpr double kTolerance = 1e-5;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("statescan_run_cli_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_ / "in");
  }
  ~TempDir() { fs::remove_all(path_); }
  fs::path in() const { return path_ / "in"; }
  fs::path out() const { return path_ / "out"; }
  fs::path file(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

void write_f32(const fs::path& path, const Shape& shape, const std::vector<double>& values) {
  const std::vector<float> f(values.begin(), values.end());
  ASSERT_EQ(static_cast<int64_t>(f.size()), numel(shape)) << path;
  write_npy(path.string(), shape, f.data());
}

// core/npy writes floats only; int64 arrays (cu_seqlens) are written by hand
// in numpy's v1.0 layout.
void write_i64(const fs::path& path, const std::vector<int64_t>& values) {
  std::string header = "{'descr': '<i8', 'fortran_order': False, 'shape': (" +
                       std::to_string(values.size()) + ",), }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {static_cast<char>(header.size() & 0xff),
                       static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out << header;
  out.write(reinterpret_cast<const char*>(values.data()),
            static_cast<std::streamsize>(values.size() * sizeof(int64_t)));
}

struct Inputs {
  ref::Problem problem;          // float32-representable values
  std::vector<double> d_o, dht;  // likewise
};

Inputs make_inputs(Variant variant, std::vector<int64_t> cu_seqlens, uint64_t seed) {
  test::ProblemSpec spec;
  spec.variant = variant;
  spec.batch = 1;
  spec.seq_len = kSeqLen;
  spec.heads = kHeads;
  spec.dk = kDk;
  spec.dv = kDv;
  spec.with_h0 = true;
  spec.cu_seqlens = std::move(cu_seqlens);
  Inputs in;
  in.problem = test::random_problem(spec, seed);
  ref::Problem& p = in.problem;
  p.q = test::round_f32(p.q);
  p.k = test::round_f32(p.k);
  p.v = test::round_f32(p.v);
  p.g = test::round_f32(p.g);
  p.beta = test::round_f32(p.beta);
  p.h0 = test::round_f32(p.h0);
  std::mt19937_64 rng(seed + 1000);
  in.d_o = test::round_f32(test::randn(static_cast<std::size_t>(kSeqLen * kHeads * kDv), rng));
  in.dht = test::round_f32(
      test::randn(static_cast<std::size_t>(p.num_sequences() * kHeads * kDk * kDv), rng));
  return in;
}

void write_inputs(const Inputs& in, const fs::path& dir) {
  const ref::Problem& p = in.problem;
  const int64_t N = p.num_sequences();
  const Shape qk{1, kSeqLen, kHeads, kDk}, vo{1, kSeqLen, kHeads, kDv}, bth{1, kSeqLen, kHeads};
  const Shape states{N, kHeads, kDk, kDv};
  write_f32(dir / "q.npy", qk, p.q);
  write_f32(dir / "k.npy", qk, p.k);
  write_f32(dir / "v.npy", vo, p.v);
  if (has_gate(p.variant)) write_f32(dir / "g.npy", vector_gate(p.variant) ? qk : bth, p.g);
  if (has_beta(p.variant)) write_f32(dir / "beta.npy", bth, p.beta);
  write_f32(dir / "h0.npy", states, p.h0);
  write_f32(dir / "do.npy", vo, in.d_o);
  write_f32(dir / "dht.npy", states, in.dht);
  if (!p.cu_seqlens.empty()) write_i64(dir / "cu_seqlens.npy", p.cu_seqlens);
}

struct RunResult {
  int exit_code = -1;
  std::string out;                    // stdout (rank 0's table)
  std::vector<std::string> rank_err;  // each rank's own stderr
  std::string err;                    // mpirun's stderr, then every rank's
};

std::string slurp(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The shell's name for the rank it runs in (Open MPI's, else MPICH's), for
// per-rank files.
const std::string kRankVar = "${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-unknown}}";

// The shell command that runs statescan-run --device cpu `args` under mpirun
// on kRanks ranks (one thread each), each rank through `sh -c rank_script`
// with the binary as $0 and the arguments as "$@". mpirun is exec'd, so that
// a signal to the shell reaches it.
std::string mpirun_command(const std::string& rank_script, const std::string& args) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 STATESCAN_NUM_THREADS=1 exec " +
         std::string(STATESCAN_MPIEXEC) + " -np " + std::to_string(kRanks) +
         " --oversubscribe sh -c '" + rank_script + "' " + STATESCAN_RUN_PATH + " --device cpu " +
         args;
}

// The rank script that runs the binary with each rank's stderr in
// `prefix` + its rank.
std::string rank_stderr_to(const std::string& prefix) {
  return "exec \"$0\" \"$@\" 2>\"" + prefix + kRankVar + "\"";
}

// Runs statescan-run under mpirun with `args`. Each rank writes its stderr
// straight to a file of its own, so the test sees exactly what every rank
// printed (mpirun's forwarding may drop a rank's last lines when it tears the
// job down after a non-zero exit). `common` precedes `args`: the mixer's chunk
// by default (--variant lact refuses --chunk).
RunResult run_cli(const TempDir& dir, const std::string& args,
                  const std::string& common = "--chunk " + std::to_string(kChunk)) {
  const fs::path out = dir.file("stdout.txt"), err = dir.file("stderr.txt");
  const std::string rank_err = dir.file("stderr.rank").string();
  const std::string command = mpirun_command(rank_stderr_to(rank_err), common + " " + args) + " >" +
                              out.string() + " 2>" + err.string();
  const int status = std::system(command.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  for (int rank = 0; rank < kRanks; ++rank) {
    r.rank_err.push_back(slurp(rank_err + std::to_string(rank)));
    r.err += "[rank " + std::to_string(rank) + " stderr] " + r.rank_err.back();
  }
  return r;
}

std::string io_args(const TempDir& dir) {
  return "--load " + dir.in().string() + " --save " + dir.out().string() + " --iters 1 --warmup 0";
}

std::set<std::string> files_in(const fs::path& dir) {
  std::set<std::string> names;
  if (!fs::exists(dir)) return names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename());
  return names;
}

// Reads `name` from the --save dir, checks its shape and dtype.
std::vector<double> read_output(const TempDir& dir, const std::string& name, const Shape& shape) {
  const NpyArray a = read_npy((dir.out() / name).string());
  EXPECT_EQ(a.descr, "<f4") << name;
  EXPECT_EQ(a.shape, shape) << name;
  return a.data;
}

// Every saved output against ref::forward / ref::backward.
void expect_outputs_match_reference(const TempDir& dir, const Inputs& in) {
  const ref::Problem& p = in.problem;
  const int64_t N = p.num_sequences();
  const Shape qk{1, kSeqLen, kHeads, kDk}, vo{1, kSeqLen, kHeads, kDv}, bth{1, kSeqLen, kHeads};
  const Shape states{N, kHeads, kDk, kDv};
  const ref::Outputs fwd = ref::forward(p);
  const ref::Grads grads = ref::backward(p, in.d_o, in.dht);

  std::set<std::string> expected{"o.npy", "ht.npy", "dq.npy", "dk.npy", "dv.npy", "dh0.npy"};
  if (has_gate(p.variant)) expected.insert("dg.npy");
  if (has_beta(p.variant)) expected.insert("dbeta.npy");
  EXPECT_EQ(files_in(dir.out()), expected);

  EXPECT_LE(rel_rms(read_output(dir, "o.npy", vo), fwd.o), kTolerance) << "o";
  EXPECT_LE(rel_rms(read_output(dir, "ht.npy", states), fwd.ht), kTolerance) << "ht";
  EXPECT_LE(rel_rms(read_output(dir, "dq.npy", qk), grads.dq), kTolerance) << "dq";
  EXPECT_LE(rel_rms(read_output(dir, "dk.npy", qk), grads.dk), kTolerance) << "dk";
  EXPECT_LE(rel_rms(read_output(dir, "dv.npy", vo), grads.dv), kTolerance) << "dv";
  EXPECT_LE(rel_rms(read_output(dir, "dh0.npy", states), grads.dh0), kTolerance) << "dh0";
  if (has_gate(p.variant)) {
    EXPECT_LE(rel_rms(read_output(dir, "dg.npy", vector_gate(p.variant) ? qk : bth), grads.dg),
              kTolerance)
        << "dg";
  }
  if (has_beta(p.variant)) {
    EXPECT_LE(rel_rms(read_output(dir, "dbeta.npy", bth), grads.dbeta), kTolerance) << "dbeta";
  }
}

int count_occurrences(const std::string& text, const std::string& needle) {
  int n = 0;
  for (std::size_t pos = text.find(needle); pos != std::string::npos;
       pos = text.find(needle, pos + 1))
    ++n;
  return n;
}

// Every rank printed exactly one error line, and it contains `needle`.
void expect_every_rank_reports(const RunResult& r, const std::string& needle) {
  for (int rank = 0; rank < kRanks; ++rank) {
    const std::string& err = r.rank_err[static_cast<std::size_t>(rank)];
    EXPECT_EQ(count_occurrences(err, "statescan-run: "), 1) << "rank " << rank << ": " << err;
    EXPECT_NE(err.find(needle), std::string::npos) << "rank " << rank << ": " << err;
  }
}

// ---- every variant x exchange, batch-row layout -----------------------------------

class RunCliExchange : public ::testing::TestWithParam<std::tuple<Variant, Exchange>> {};

TEST_P(RunCliExchange, SavedOutputsMatchReference) {
  const auto [variant, exchange_kind] = GetParam();
  const std::string exchange = to_string(exchange_kind);
  TempDir dir;
  const Inputs in = make_inputs(variant, {}, 17 + static_cast<uint64_t>(variant));
  write_inputs(in, dir.in());
  const RunResult r = run_cli(dir, "--variant " + std::string(to_string(variant)) + " --exchange " +
                                       exchange + " " + io_args(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("# Wrong outputs: 0 OK"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("exchange " + exchange), std::string::npos) << r.out;
  expect_outputs_match_reference(dir, in);
}

INSTANTIATE_TEST_SUITE_P(AllVariants, RunCliExchange,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::Values(Exchange::allgather, Exchange::ring,
                                                              Exchange::tree)),
                         [](const auto& info) {
                           return test::variant_name(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// ---- packed sequences across rank boundaries ------------------------------------------

class RunCliPacked : public ::testing::TestWithParam<Variant> {};

TEST_P(RunCliPacked, SavedOutputsMatchReference) {
  const Variant variant = GetParam();
  TempDir dir;
  // Shards are [0,15) [15,30) [30,45): a sequence starts exactly on the
  // first boundary, one lies inside rank 1, one crosses the second boundary.
  const Inputs in = make_inputs(variant, {0, 15, 20, 38, 45}, 71 + static_cast<uint64_t>(variant));
  write_inputs(in, dir.in());
  const RunResult r =
      run_cli(dir, "--variant " + std::string(to_string(variant)) + " " + io_args(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("4 (packed)"), std::string::npos) << r.out;
  expect_outputs_match_reference(dir, in);
}

INSTANTIATE_TEST_SUITE_P(AllVariants, RunCliPacked, ::testing::ValuesIn(kAllVariants),
                         [](const auto& info) { return test::variant_name(info.param); });

TEST(RunCli, ExplicitUnevenShardsMatchReference) {
  TempDir dir;
  const Inputs in = make_inputs(Variant::kda, {0, 3, 9, 40, 45}, 5);
  write_inputs(in, dir.in());
  const RunResult r = run_cli(dir, "--variant kda --exchange tree --shards 7,30,8 " + io_args(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("shards 7,30,8"), std::string::npos) << r.out;
  expect_outputs_match_reference(dir, in);
}

// --recompute-states keeps no chunk states between the passes: the saved
// outputs still match the reference, and the header says so.
TEST(RunCli, RecomputedChunkStatesMatchReference) {
  TempDir dir;
  const Inputs in = make_inputs(Variant::gated_deltanet, {0, 3, 9, 40, 45}, 6);
  write_inputs(in, dir.in());
  const RunResult r =
      run_cli(dir, "--variant gated_deltanet --recompute-states --exchange ring " + io_args(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("chunk states recomputed"), std::string::npos) << r.out;
  expect_outputs_match_reference(dir, in);
}

// The footer splits every rank's passes into phases (mean over the timed
// steps): each phase is a part of the pass's wall time, and the JSON carries
// the same numbers.
TEST(RunCli, FooterSplitsEveryRanksPassesIntoPhases) {
  TempDir dir;
  const Inputs in = make_inputs(Variant::kda, {}, 11);
  write_inputs(in, dir.in());
  const fs::path json = dir.file("run.json");
  const RunResult r = run_cli(dir, "--variant kda --exchange ring --load " + dir.in().string() +
                                       " --iters 2 --warmup 1 --json " + json.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < kRanks; ++rank)
    for (const char* pass : {"fwd local ", "bwd local "})
      EXPECT_NE(r.out.find("# rank " + std::to_string(rank) + "  " + pass), std::string::npos)
          << "rank " << rank << " " << pass << "\n"
          << r.out;
  // One "fwd" and one "bwd" object per rank, each phase within its wall time.
  const std::string text = slurp(json);
  int passes = 0;
  for (std::size_t pos = text.find("\"local_ms\": "); pos != std::string::npos;
       pos = text.find("\"local_ms\": ", pos + 1)) {
    double v[6] = {};
    ASSERT_EQ(std::sscanf(text.c_str() + pos,
                          "\"local_ms\": %lf, \"summary_ms\": %lf, \"exchange_ms\": %lf, "
                          "\"merge_ms\": %lf, \"wall_ms\": %lf, \"prepare_ms\": %lf",
                          &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]),
              6)
        << text.substr(pos, 160);
    EXPECT_GT(v[4], 0.0) << text.substr(pos, 160);
    EXPECT_EQ(v[5], 0.0) << "the host path has no prepare stage: " << text.substr(pos, 160);
    for (int i = 0; i < 4; ++i) {
      EXPECT_GE(v[i], 0.0) << text.substr(pos, 160);
      EXPECT_LE(v[i], v[4]) << text.substr(pos, 160);
    }
    ++passes;
  }
  EXPECT_EQ(passes, 2 * kRanks) << text;
  // A row's exchange bytes are the most any rank sent (the ring's middle rank
  // sends both ways, its ends one way): the ranks' bytes of the last step.
  int64_t most = 0;
  int ranks = 0;
  for (std::size_t pos = text.find("{\"exchange_ms\": "); pos != std::string::npos;
       pos = text.find("{\"exchange_ms\": ", pos + 1)) {
    long long bytes = 0;
    ASSERT_EQ(
        std::sscanf(text.c_str() + pos, "{\"exchange_ms\": %*f, \"exchange_bytes\": %lld", &bytes),
        1)
        << text.substr(pos, 120);
    most = std::max<int64_t>(most, bytes);
    ++ranks;
  }
  ASSERT_EQ(ranks, kRanks) << text;
  int rows = 0;
  for (std::size_t pos = text.find("{\"step\": "); pos != std::string::npos;
       pos = text.find("{\"step\": ", pos + 1)) {
    const std::size_t at = text.find("\"exchange_bytes\": ", pos);
    long long bytes = -1;
    ASSERT_EQ(std::sscanf(text.c_str() + at, "\"exchange_bytes\": %lld", &bytes), 1);
    EXPECT_EQ(bytes, most) << text.substr(pos, 200);
    ++rows;
  }
  EXPECT_EQ(rows, 2) << text;
}

// JSON text is UTF-8: a --load path that is not (a byte 0xff) reaches the
// header as U+FFFD beside its escaped quote and a valid two-byte character,
// and the file stays JSON (the byte was copied raw).
TEST(RunCli, JsonStaysUtf8ForAPathThatIsNot) {
  TempDir dir;
  const Inputs in = make_inputs(Variant::kda, {}, 12);
  const fs::path odd = dir.file(std::string("in\xff\"q\xc3\xa9"));
  fs::create_directories(odd);
  write_inputs(in, odd);
  const fs::path json = dir.file("run.json");
  const RunResult r = run_cli(dir, "--variant kda --load '" + odd.string() +
                                       "' --iters 1 --warmup 0 --no-check --json " + json.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string text = slurp(json);
  EXPECT_EQ(text.find('\xff'), std::string::npos) << text;
  EXPECT_NE(text.find("in\\ufffd\\\"q\xc3\xa9"), std::string::npos) << text;
}

// The average throughput is the steps' tokens over their time: with steps of
// different lengths it is not the mean of their rates.
TEST(RunCli, AverageThroughputIsTokensOverTime) {
  TempDir dir;
  const fs::path json = dir.file("run.json");
  const RunResult r = run_cli(
      dir, "--variant gla --seq-len 96 --iters 4 --warmup 0 --no-check --json " + json.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string text = slurp(json);
  double tokens = 0, seconds = 0, mean_rate = 0;
  int rows = 0;
  for (std::size_t pos = text.find("{\"step\": "); pos != std::string::npos;
       pos = text.find("{\"step\": ", pos + 1)) {
    int step = 0;
    double fwd = 0, bwd = 0, rate = 0;
    ASSERT_EQ(std::sscanf(text.c_str() + pos, "{\"step\": %d, \"fwd_ms\": %lf, \"bwd_ms\": %lf",
                          &step, &fwd, &bwd),
              3)
        << text.substr(pos, 160);
    const std::size_t at = text.find("\"tokens_per_s\": ", pos);
    ASSERT_NE(at, std::string::npos);
    ASSERT_EQ(std::sscanf(text.c_str() + at, "\"tokens_per_s\": %lf", &rate), 1);
    // Each row's rate is the step's B*T tokens over its forward + backward
    // wall time (not the forward's alone).
    EXPECT_NEAR(rate, 96 * 1e3 / (fwd + bwd), 1e-6 * rate) << text.substr(pos, 240);
    tokens += rate * (fwd + bwd);
    seconds += fwd + bwd;
    mean_rate += rate / 4;
    ++rows;
  }
  ASSERT_EQ(rows, 4) << text;
  const std::size_t avg = text.find("\"avg\": ");
  ASSERT_NE(avg, std::string::npos) << text;
  double fwd = 0, bwd = 0, exchange = 0, rate = 0;
  ASSERT_EQ(std::sscanf(text.c_str() + avg,
                        "\"avg\": {\"fwd_ms\": %lf, \"bwd_ms\": %lf, \"exchange_ms\": %lf, "
                        "\"tokens_per_s\": %lf",
                        &fwd, &bwd, &exchange, &rate),
            4)
      << text.substr(avg, 160);
  EXPECT_NEAR(rate, tokens / seconds, 1e-6 * rate) << "mean of the rates: " << mean_rate;
}

// The check compares the CP run with the single-rank run at the fp32 bar,
// 1e-5, on the CPU for every --dtype (the 16-bit bar, 1e-2 and LaCT's 2e-2,
// is the GPU's alone): the footer and the JSON say so.
class RunCliCheckTolerance : public ::testing::TestWithParam<std::pair<std::string, std::string>> {
};

TEST_P(RunCliCheckTolerance, IsTheFp32BarOnTheCpu) {
  const auto& [args, common] = GetParam();
  TempDir dir;
  const fs::path json = dir.file("run.json");
  const RunResult r = run_cli(dir, args + " --iters 1 --warmup 0 --json " + json.string(), common);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("(tolerance 1e-05)"), std::string::npos) << r.out;
  EXPECT_NE(slurp(json).find("\"check\": {\"tolerance\": 1e-05, \"wrong\": 0"), std::string::npos)
      << slurp(json);
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, RunCliCheckTolerance,
    ::testing::Values(
        std::pair<std::string, std::string>{"--variant gla --seq-len 45 --dtype f32", "--chunk 16"},
        std::pair<std::string, std::string>{"--variant gla --seq-len 45 --dtype bf16",
                                            "--chunk 16"},
        std::pair<std::string, std::string>{
            "--variant lact --lact-chunk 12 --dk 8 --lact-hidden 16 --seq-len 48 --dtype f32", ""},
        std::pair<std::string, std::string>{
            "--variant lact --lact-chunk 12 --dk 8 --lact-hidden 16 --seq-len 48 --dtype bf16",
            ""}),
    [](const auto& info) {
      return std::string(info.param.first.find("lact") != std::string::npos ? "lact_" : "gla_") +
             (info.param.first.find("bf16") != std::string::npos ? "bf16" : "f32");
    });

// The check compares against the single-rank run, not the CP run against
// itself: T = 45 over 3 ranks puts shard boundaries inside chunks, so the two
// runs sum in different orders and some output differs in its last bits
// (deterministic: the same inputs and one thread per rank every time).
TEST(RunCli, CheckMeasuresTheSingleRankRunsDifference) {
  TempDir dir;
  const fs::path json = dir.file("run.json");
  const RunResult r =
      run_cli(dir, "--variant kda --seq-len 45 --exchange ring --iters 1 --warmup 0 --json " +
                       json.string());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string text = slurp(json);
  const std::size_t at = text.find("\"rel_rms\": {");
  ASSERT_NE(at, std::string::npos) << text;
  double largest = 0;
  int outputs = 0;
  const std::size_t end = text.find('}', at);
  for (std::size_t pos = text.find("\": ", at + 12); pos != std::string::npos && pos < end;
       pos = text.find("\": ", pos + 1)) {
    double err = -1;
    ASSERT_EQ(std::sscanf(text.c_str() + pos, "\": %lf", &err), 1) << text.substr(pos, 80);
    largest = std::max(largest, err);
    ++outputs;
  }
  EXPECT_EQ(outputs, 7) << text;  // o ht dq dk dv dg dbeta (no h0: synthetic)
  EXPECT_GT(largest, 0.0) << "every output equals the reference bit for bit: " << text;
  EXPECT_LE(largest, kTolerance) << text;
}

// --seed picks the synthetic inputs: the header names it, and another seed
// gives other outputs.
TEST(RunCli, SeedPicksTheSyntheticInputs) {
  TempDir dir;
  std::vector<double> o[2];
  for (int i = 0; i < 2; ++i) {
    const std::string seed = std::to_string(7 + i);
    const RunResult r =
        run_cli(dir, "--variant gla --seq-len 45 --seed " + seed +
                         " --iters 1 --warmup 0 --no-check --save " + dir.out().string());
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("inputs synthetic (seed " + seed + ")"), std::string::npos) << r.out;
    o[i] = read_output(dir, "o.npy", {1, 45, 4, 64});
  }
  EXPECT_GT(rel_rms(o[0], o[1]), 0.1) << "--seed 7 and --seed 8 gave the same outputs";
}

// As many tokens as ranks is the smallest sequence that splits: it runs.
TEST(RunCli, OneTokenPerRankRuns) {
  TempDir dir;
  const RunResult r = run_cli(dir, "--variant kda --seq-len 3 --iters 1 --warmup 0");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("shards 1,1,1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("# Wrong outputs: 0 OK"), std::string::npos) << r.out;
}

// Outputs over the tolerance fail the run with exit 1 (not 0, and not 2: the
// arguments and inputs were valid), the footer says FAILED, and the JSON
// counts them. A NaN let through by --no-check-finite makes every output
// that depends on it non-finite in both runs, which the check counts as wrong.
TEST(RunCli, OutputsOverToleranceExitOne) {
  TempDir dir;
  Inputs in = make_inputs(Variant::gla, {}, 21);
  in.problem.v[(30 * kHeads + 1) * kDv + 2] = std::numeric_limits<double>::quiet_NaN();
  write_inputs(in, dir.in());
  const fs::path json = dir.file("run.json");
  const RunResult r =
      run_cli(dir, "--variant gla --no-check-finite " + io_args(dir) + " --json " + json.string());
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const std::size_t at = r.out.find("# Wrong outputs: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  int wrong = 0;
  char verdict[16] = {};
  ASSERT_EQ(std::sscanf(r.out.c_str() + at, "# Wrong outputs: %d %15s", &wrong, verdict), 2);
  EXPECT_GT(wrong, 0) << r.out;
  EXPECT_STREQ(verdict, "FAILED") << r.out;
  EXPECT_NE(slurp(json).find("\"wrong\": " + std::to_string(wrong) + ", \"rel_rms\""),
            std::string::npos)
      << slurp(json);
}

// Every rank exits 1, not rank 0 alone (a launcher that reads each rank's
// status, srun say, must not see a half-successful job): each rank's own exit
// status, recorded by its shell.
TEST(RunCli, OutputsOverToleranceExitOneOnEveryRank) {
  TempDir dir;
  Inputs in = make_inputs(Variant::gla, {}, 23);
  in.problem.v[(5 * kHeads + 0) * kDv + 1] = std::numeric_limits<double>::quiet_NaN();
  write_inputs(in, dir.in());
  const std::string rc = dir.file("rc.rank").string();
  const std::string command =
      mpirun_command("\"$0\" \"$@\" 2>/dev/null; echo $? >\"" + rc + kRankVar + "\"",
                     "--chunk 16 --variant gla --no-check-finite " + io_args(dir)) +
      " >/dev/null";
  ASSERT_EQ(std::system(command.c_str()), 0) << "the ranks' shells exit 0";
  for (int rank = 0; rank < kRanks; ++rank)
    EXPECT_EQ(slurp(rc + std::to_string(rank)), "1\n") << "rank " << rank;
}

// ---- arguments refused, naming the flag, before anything runs --------------------------

struct Refusal {
  const char* name;
  std::string args;    // after --device cpu
  std::string common;  // run_cli's `common` (the mixer's --chunk, or nothing for LaCT)
  std::string needle;  // every rank's error line contains it
};

void PrintTo(const Refusal& c, std::ostream* os) {
  *os << c.name;
}

const std::string kLactArgs = "--variant lact --lact-chunk 12 --dk 8 --lact-hidden 16 --seq-len 48";
const std::string kMixerChunk = "--chunk " + std::to_string(kChunk);

class RunCliRefuses : public ::testing::TestWithParam<Refusal> {};

TEST_P(RunCliRefuses, NamingTheFlagOnEveryRank) {
  const Refusal& c = GetParam();
  TempDir dir;
  const RunResult r = run_cli(dir, c.args + " --iters 1 --warmup 0", c.common);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, c.needle);
  EXPECT_EQ(r.out.find("# Avg"), std::string::npos) << "ran anyway:\n" << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Flags, RunCliRefuses,
    ::testing::Values(
        // LaCT's momentum is in [0, 1): 1 is refused by the flag, not later by the layer.
        Refusal{"momentum_one", kLactArgs + " --momentum 1", "",
                "argument '--momentum': must be in [0, 1)"},
        // Every rank needs a token: a zero in --shards is refused.
        Refusal{"zero_shard", "--seq-len 45 --shards 0,30,15", kMixerChunk,
                "argument '--shards': must be in [1, "},
        Refusal{"dk_257", "--seq-len 45 --dk 257", kMixerChunk,
                "argument '--dk': must be in [1, 256]"},
        Refusal{"iters_zero", "--seq-len 45 --iters 0", kMixerChunk,
                "argument '--iters': must be in [1, "},
        Refusal{"metrics_port_zero", "--seq-len 45 --metrics-port 0", kMixerChunk,
                "argument '--metrics-port': must be in [1, 65535]"},
        // q, k, v share D under LaCT.
        Refusal{"lact_dv_not_dk", kLactArgs + " --dv 16", "",
                "argument '--dv': must equal --dk for --variant lact"},
        Refusal{"metrics_hold_without_port", "--seq-len 45 --metrics-hold 1", kMixerChunk,
                "argument '--metrics-hold': needs --metrics-port"},
        Refusal{"metrics_bind_without_port", "--seq-len 45 --metrics-bind 0.0.0.0", kMixerChunk,
                "argument '--metrics-bind': needs --metrics-port"},
        // Checked while parsing, before the (missing) directory is looked at.
        Refusal{"seed_with_load", "--load /nonexistent-statescan-dir --seed 3", kMixerChunk,
                "argument '--seed': does not apply with --load"},
        Refusal{"momentum_without_lact", "--seq-len 45 --variant kda --momentum 0.5", kMixerChunk,
                "argument '--momentum': applies to --variant lact only"},
        Refusal{"lact_no_check_finite", kLactArgs + " --no-check-finite", "",
                "argument '--no-check-finite': does not apply to --variant lact"},
        Refusal{"lact_scale", kLactArgs + " --scale 0.5", "",
                "argument '--scale': does not apply to --variant lact"},
        // fp32 inputs save no T on any device: refused as such, not by the
        // CPU path's "--device cuda only" rule (whose text also says "saves no T").
        Refusal{"no_save_t_f32", "--seq-len 45 --variant deltanet --dtype f32 --no-save-t",
                kMixerChunk,
                "argument '--no-save-t': applies to deltanet and gated_deltanet with --dtype bf16 "
                "or f16 only (deltanet with f32 saves no T)"}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- --metrics-port: every rank serves its own step on port + local rank ---------------

// A free TCP port p on loopback with p + 1 .. p + n - 1 free too (0: none found).
int free_port_block(int n) {
  auto bindable = [](int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    socklen_t len = sizeof addr;
    const int got = ok && ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0
                        ? ntohs(addr.sin_port)
                        : 0;
    ::close(fd);
    return got;
  };
  for (int attempt = 0; attempt < 20; ++attempt) {
    const int p = bindable(0);
    if (p == 0 || p + n > 65535) continue;
    bool all = true;
    for (int i = 1; i < n && all; ++i) all = bindable(p + i) != 0;
    if (all) return p;
  }
  return 0;
}

// The body of GET http://127.0.0.1:port/metrics ("" when nothing answers).
std::string scrape_metrics(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (::send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    ::close(fd);
    return "";
  }
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    raw.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  const std::size_t body = raw.find("\r\n\r\n");
  return body == std::string::npos ? "" : raw.substr(body + 4);
}

// The value of the sample `name` whose labels include every one of `labels`
// (each as `key="value"`); NaN when there is none.
double metric(const std::string& text, const std::string& name,
              std::initializer_list<std::string> labels) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + "{", 0) != 0) continue;
    const std::size_t close = line.find("} ");
    bool match = close != std::string::npos;
    for (const std::string& l : labels) match = match && line.find(l) < close;
    if (match) return std::stod(line.substr(close + 2));
  }
  return std::numeric_limits<double>::quiet_NaN();
}

struct MetricsCase {
  const char* name;
  std::string args, common;
  const char* variant;     // the variant label
  double flops_per_token;  // the FLOP model's count of one token (all heads), fwd + bwd
};

void PrintTo(const MetricsCase& c, std::ostream* os) {
  *os << c.name;
}

class RunCliMetrics : public ::testing::TestWithParam<MetricsCase> {};

// Each rank serves its own step on --metrics-port + its node-local rank: its
// shard's tokens, forward and backward time, and the step's FLOPs (forward +
// backward) over its time. Scraped while --metrics-hold keeps the exporters up.
TEST_P(RunCliMetrics, EveryRankServesItsStepsOnItsOwnPort) {
  const MetricsCase& c = GetParam();
  const int port = free_port_block(kRanks);
  if (port == 0) GTEST_SKIP() << "no block of " << kRanks << " free ports";
  TempDir dir;
  const fs::path out = dir.file("stdout.txt");
  const std::string rank_err = dir.file("stderr.rank").string();
  const std::string command =
      mpirun_command(rank_stderr_to(rank_err),
                     c.common + " " + c.args + " --iters 2 --warmup 0 --no-check --metrics-port " +
                         std::to_string(port) + " --metrics-hold 20") +
      " >" + out.string() + " 2>" + dir.file("stderr.txt").string();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Rank 0 says when it holds: every rank's steps are done by then (the
  // results' agreement is collective).
  bool holding = false;
  for (int i = 0; i < 600 && !holding; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    holding = slurp(rank_err + "0").find("holding the metrics exporters") != std::string::npos;
    if (::waitpid(pid, nullptr, WNOHANG) == pid) break;
  }
  std::string text[kRanks];
  if (holding)
    for (int r = 0; r < kRanks; ++r) text[r] = scrape_metrics(port + r);
  ::kill(pid, SIGUSR1);  // mpirun forwards it: the hold ends early
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string err0 = slurp(rank_err + "0");
  if (err0.find("built without Prometheus") != std::string::npos)
    GTEST_SKIP() << "statescan-run was built without Prometheus";
  ASSERT_TRUE(holding) << slurp(out) << err0 << slurp(rank_err + "1") << slurp(rank_err + "2");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << slurp(out);
  EXPECT_NE(err0.find("metrics on http://127.0.0.1:" + std::to_string(port) + "/metrics"),
            std::string::npos)
      << err0;
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " on port " + std::to_string(port + r));
    const std::string rank = "rank=\"" + std::to_string(r) + "\"";
    const std::string variant = std::string("variant=\"") + c.variant + "\"";
    ASSERT_FALSE(text[r].empty());
    // Two steps of this rank's 16 (LaCT) or 15 (T = 45) tokens.
    const double tokens = metric(text[r], "statescan_tokens_total", {rank, variant});
    EXPECT_EQ(tokens, std::string(c.variant) == "lact" ? 32 : 30);
    for (const char* phase : {"fwd", "bwd"})
      EXPECT_GT(metric(text[r], "statescan_phase_seconds_total",
                       {rank, variant, std::string("phase=\"") + phase + "\""}),
                0.0)
          << phase << "\n"
          << text[r];
    // TFLOP/s over tokens/s of the last step: the FLOPs the model counts per token.
    const double per_token = metric(text[r], "statescan_achieved_tflops", {rank, variant}) * 1e12 /
                             metric(text[r], "statescan_tokens_per_second", {rank, variant});
    EXPECT_NEAR(per_token, c.flops_per_token, 1e-6 * c.flops_per_token) << text[r];
  }
}

// Chunkwise linear attention (monitoring/flop_model.h): per token and head,
// forward C (Dk + Dv) + 4 Dk Dv, backward C (3 Dk + 2 Dv) + 8 Dk Dv; LaCT 64 M D.
INSTANTIATE_TEST_SUITE_P(
    Jobs, RunCliMetrics,
    ::testing::Values(
        MetricsCase{"linear", "--variant linear --seq-len 45 --heads 2 --dk 8 --dv 8", "--chunk 16",
                    "linear", (16.0 * (8 + 8) + 4 * 64 + 16.0 * (3 * 8 + 2 * 8) + 8 * 64) * kHeads},
        MetricsCase{"lact",
                    "--variant lact --lact-chunk 12 --dk 8 --lact-hidden 16 --seq-len 48 "
                    "--heads 2",
                    "", "lact", kHeads * 64.0 * 16 * 8}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- bad input: every rank reports it, nothing is written ------------------------------

// The error names the file and the element's index in it (the library's own
// check would name g and an index within rank 1's shard).
TEST(RunCli, NaNInGateFailsOnEveryRankWithoutWriting) {
  TempDir dir;
  Inputs in = make_inputs(Variant::gated_deltanet, {}, 9);
  in.problem.g[20 * kHeads + 1] = std::numeric_limits<double>::quiet_NaN();  // rank 1's shard
  write_inputs(in, dir.in());
  const RunResult r = run_cli(dir, "--variant gated_deltanet " + io_args(dir));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "g.npy': ");
  expect_every_rank_reports(r, "element [0, 20, 1] is nan");
  EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
}

// A positive log gate in a file likewise, and Inf in another input.
TEST(RunCli, BadValuesInFilesNameTheFileAndTheElement) {
  for (const bool gate : {true, false}) {
    TempDir dir;
    Inputs in = make_inputs(Variant::gla, {}, 16);
    if (gate)
      in.problem.g[(7 * kHeads + 1) * kDk + 3] = 0.5;  // GLA's vector gate [B, T, H, Dk]
    else
      in.problem.k[(30 * kHeads) * kDk + 2] = std::numeric_limits<double>::infinity();
    write_inputs(in, dir.in());
    const RunResult r = run_cli(dir, "--variant gla " + io_args(dir));
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    expect_every_rank_reports(r, gate ? "g.npy': " : "k.npy': ");
    expect_every_rank_reports(r, gate ? "element [0, 7, 1, 3] is 0.5 (log gates"
                                      : "element [0, 30, 0, 2] is inf");
    EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
  }
}

TEST(RunCli, WrongShapeOfVFailsOnEveryRankWithoutWriting) {
  TempDir dir;
  const Inputs in = make_inputs(Variant::deltanet, {}, 10);
  write_inputs(in, dir.in());
  // v with one token fewer than q.
  write_f32(dir.in() / "v.npy", {1, kSeqLen - 1, kHeads, kDv},
            std::vector<double>(in.problem.v.begin(), in.problem.v.end() - kHeads * kDv));
  const RunResult r = run_cli(dir, "--variant deltanet " + io_args(dir));
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "v.npy'");  // argument '.../in/v.npy'

  EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
}

// Loaded files that do not fit the variant or each other are refused,
// naming the file, on every rank, before anything runs or is written.
TEST(RunCli, InconsistentInputFilesAreRefusedNamingTheFile) {
  struct Case {
    const char* what;
    Variant variant;
    std::function<void(const Inputs&, const fs::path&)> change;
    std::string needle;
  };
  const Case cases[] = {
      // A gate file for a variant without decay is refused, not ignored.
      {"g.npy for deltanet", Variant::deltanet,
       [](const Inputs&, const fs::path& in) {
         write_f32(in / "g.npy", {1, kSeqLen, kHeads},
                   std::vector<double>(static_cast<std::size_t>(kSeqLen * kHeads), -0.1));
       },
       "g.npy': must not be given for variant deltanet"},
      // dht without do: there is no backward pass to take it.
      {"dht.npy without do.npy", Variant::gla,
       [](const Inputs&, const fs::path& in) { fs::remove(in / "do.npy"); },
       "dht.npy': needs do.npy"},
      // Packed sequences need B = 1: q, k, v with two batch rows.
      {"cu_seqlens with B = 2", Variant::linear,
       [](const Inputs& x, const fs::path& in) {
         const ref::Problem& p = x.problem;
         std::vector<double> q2 = p.q, k2 = p.k, v2 = p.v, do2 = x.d_o;
         q2.insert(q2.end(), p.q.begin(), p.q.end());
         k2.insert(k2.end(), p.k.begin(), p.k.end());
         v2.insert(v2.end(), p.v.begin(), p.v.end());
         do2.insert(do2.end(), x.d_o.begin(), x.d_o.end());
         write_f32(in / "q.npy", {2, kSeqLen, kHeads, kDk}, q2);
         write_f32(in / "k.npy", {2, kSeqLen, kHeads, kDk}, k2);
         write_f32(in / "v.npy", {2, kSeqLen, kHeads, kDv}, v2);
         write_f32(in / "do.npy", {2, kSeqLen, kHeads, kDv}, do2);
       },
       "packed sequences need B = 1"},
  };
  for (const Case& c : cases) {
    TempDir dir;
    const Inputs in = make_inputs(
        c.variant,
        c.variant == Variant::linear ? std::vector<int64_t>{0, 20, 45} : std::vector<int64_t>{},
        31);
    write_inputs(in, dir.in());
    c.change(in, dir.in());
    const RunResult r =
        run_cli(dir, "--variant " + std::string(to_string(c.variant)) + " " + io_args(dir));
    EXPECT_EQ(r.exit_code, 2) << c.what << "\n" << r.out << r.err;
    expect_every_rank_reports(r, c.needle);
    EXPECT_EQ(files_in(dir.out()), std::set<std::string>{}) << c.what;
  }
}

// Under --load the files give the shape: shape flags are ignored, and rank 0
// says which (once), rather than running a shape the user did not ask for
// without a word.
TEST(RunCli, ShapeFlagsIgnoredUnderLoadAreNamed) {
  TempDir dir;
  write_inputs(make_inputs(Variant::gla, {}, 35), dir.in());
  const RunResult r =
      run_cli(dir, "--variant gla --seq-len 4096 --heads 9 " + io_args(dir) + " --no-check");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.rank_err[0].find("statescan-run: note: --seq-len, --heads ignored with --load"),
            std::string::npos)
      << r.rank_err[0];
  EXPECT_NE(r.out.find("T 45"), std::string::npos) << r.out;
}

// --shards must sum to T exactly: more tokens than the sequence has is
// refused as fewer are.
TEST(RunCli, ShardsSummingPastTIsRefused) {
  TempDir dir;
  const RunResult r = run_cli(dir, "--seq-len 45 --shards 15,15,16 --iters 1 --warmup 0");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r,
                            "argument '--shards': lengths sum to 46 but the sequence has T = 45");
}

// --dtype rounds the token inputs only: the initial state stays fp32 (as the
// gates do), so bf16-representable q, k, v, do with an fp32 h0 give the fp64
// reference's outputs on that h0.
TEST(RunCli, InitialStateStaysFp32UnderBf16) {
  TempDir dir;
  Inputs in = make_inputs(Variant::retention, {}, 33);
  const auto bf16 = [](std::vector<double> x) {
    for (double& v : x) v = round_to(DType::bf16, static_cast<float>(v));
    return x;
  };
  in.problem.q = bf16(in.problem.q);
  in.problem.k = bf16(in.problem.k);
  in.problem.v = bf16(in.problem.v);
  in.d_o = bf16(in.d_o);
  ASSERT_NE(bf16(in.problem.h0), in.problem.h0) << "h0 should need fp32";
  write_inputs(in, dir.in());
  const RunResult r = run_cli(dir, "--variant retention --dtype bf16 " + io_args(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  expect_outputs_match_reference(dir, in);
}

TEST(RunCli, FailedSaveLeavesNoResultFiles) {
  TempDir dir;
  write_inputs(make_inputs(Variant::gla, {}, 12), dir.in());
  // A directory where dq.npy should go makes the save fail after o.npy and
  // ht.npy could already have been written.
  fs::create_directories(dir.out() / "dq.npy");
  const RunResult r = run_cli(dir, "--variant gla " + io_args(dir));
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  expect_every_rank_reports(r, "argument '--save'");
  EXPECT_EQ(files_in(dir.out()), std::set<std::string>{"dq.npy"});
}

// The results are all or none: a save that fails takes the JSON report
// written before it away too.
TEST(RunCli, FailedSaveLeavesNoJsonReport) {
  TempDir dir;
  write_inputs(make_inputs(Variant::gla, {}, 13), dir.in());
  fs::create_directories(dir.out() / "dq.npy");
  const fs::path json = dir.file("run.json");
  const RunResult r = run_cli(dir, "--variant gla " + io_args(dir) + " --json " + json.string());
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  expect_every_rank_reports(r, "argument '--save'");
  EXPECT_FALSE(fs::exists(json)) << "the report of a run whose results were not saved";
}

// And a report that cannot be written leaves no saved arrays. A directory
// where the report should go is refused before the run (it used to fail the
// final rename after every step had run).
TEST(RunCli, FailedJsonReportLeavesNoResultFiles) {
  TempDir dir;
  write_inputs(make_inputs(Variant::gla, {}, 14), dir.in());
  const fs::path json = dir.file("run.json");
  fs::create_directories(json / "occupied");
  const RunResult r = run_cli(dir, "--variant gla " + io_args(dir) + " --json " + json.string());
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "argument '--json'");
  EXPECT_NE(r.err.find("is a directory"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("# Avg"), std::string::npos) << "the steps ran: " << r.out;
  EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
}

// The --save folder holds one run's results: a forward-only run into the
// folder of an earlier forward + backward takes that run's gradients away.
TEST(RunCli, SaveRemovesOutputsAnEarlierRunLeft) {
  TempDir dir;
  write_inputs(make_inputs(Variant::gla, {}, 15), dir.in());
  RunResult r = run_cli(dir, "--variant gla " + io_args(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  ASSERT_TRUE(files_in(dir.out()).count("dq.npy")) << "the first run wrote no gradients";
  fs::remove(dir.in() / "do.npy");
  fs::remove(dir.in() / "dht.npy");
  std::ofstream(dir.out() / "notes.txt") << "not an output";
  r = run_cli(dir, "--variant gla " + io_args(dir));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(files_in(dir.out()), (std::set<std::string>{"o.npy", "ht.npy", "notes.txt"}));
}

// Without a GPU (CI, or a build without CUDA) an explicit --device cuda is an
// error on every rank, never a silent CPU run. (With GPUs it runs: the GPU
// suites test that path.)
TEST(RunCli, CudaDeviceWithoutGpuIsRefusedOnEveryRank) {
#ifdef STATESCAN_HAS_CUDA
  if (cuda::device_available()) GTEST_SKIP() << "a GPU is present: --device cuda runs here";
#endif
  TempDir dir;
  const RunResult r = run_cli(dir, "--device cuda --seq-len 45 --iters 1 --warmup 0");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "argument '--device'");
  EXPECT_EQ(r.out.find("# Wrong"), std::string::npos) << "ran anyway:\n" << r.out;
}

// --cp-comm nccl asks for the GPU exchange: on the CPU path (which exchanges
// over MPI) it is refused on every rank, for the linear-attention variants
// and LaCT alike, rather than ignored.
TEST(RunCli, NcclExchangeIsRefusedOnTheCpuPath) {
  TempDir dir;
  // (LaCT refuses the mixer's --chunk that run_cli passes by default.)
  const std::pair<std::string, std::string> jobs[] = {
      {"kda", "--chunk " + std::to_string(kChunk)},
      {"lact --lact-chunk 12 --dk 8 --lact-hidden 16", ""}};
  for (const auto& [variant, common] : jobs) {
    const RunResult r = run_cli(
        dir, "--variant " + variant + " --cp-comm nccl --seq-len 48 --iters 1 --warmup 0", common);
    EXPECT_EQ(r.exit_code, 2) << variant << "\n" << r.out << r.err;
    expect_every_rank_reports(r, "argument '--cp-comm'");
    EXPECT_EQ(r.out.find("# Avg"), std::string::npos) << "ran anyway:\n" << r.out;
  }
}

// With more ranks than GPUs (this suite runs 3 ranks), --device cuda
// exchanges over MPI by default (the header says so), and an explicit
// --cp-comm nccl is refused on every rank naming the flag: NCCL needs a GPU per
// rank, and nothing falls back silently. Both variants' jobs follow the rule.
TEST(RunCli, SharedGpuExchangesOverMpiUnlessNcclIsAskedFor) {
#ifdef STATESCAN_HAS_CUDA
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices >= kRanks)
    GTEST_SKIP() << "a GPU per rank: NCCL runs here";
  TempDir dir;
  const std::pair<std::string, std::string> jobs[] = {
      {"kda", "--chunk " + std::to_string(kChunk)},
      {"lact --lact-chunk 12 --dk 8 --lact-hidden 16 --dtype f32", ""}};
  for (const auto& [variant, common] : jobs) {
    const std::string args =
        "--variant " + variant + " --device cuda --seq-len 48 --iters 1 --warmup 0";
    const RunResult ran = run_cli(dir, args, common);
    EXPECT_EQ(ran.exit_code, 0) << variant << "\n" << ran.out << ran.err;
    EXPECT_EQ(ran.out.find("nccl"), std::string::npos) << variant << ": " << ran.out;
    EXPECT_NE(ran.out.find("host-staged"), std::string::npos) << variant << ": " << ran.out;
    const RunResult refused = run_cli(dir, args + " --cp-comm nccl", common);
    EXPECT_EQ(refused.exit_code, 2) << variant << "\n" << refused.out << refused.err;
    expect_every_rank_reports(refused, "argument '--cp-comm'");
  }
#else
  GTEST_SKIP() << "a build without CUDA";
#endif
}

TEST(RunCli, UnknownVariantListsEveryChoice) {
  TempDir dir;
  const RunResult r = run_cli(dir, "--variant mamba --iters 1 --warmup 0");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "gated_deltanet, kda or lact)");
}

// --keep-prepared is a CUDA-path option: refused (not ignored) on the CPU path
// and next to --recompute-states, on every rank, before anything runs.
TEST(RunCli, KeepPreparedIsRefusedWhereItCannotApply) {
  TempDir dir;
  for (const std::string extra : {"", " --device cuda --recompute-states"}) {
    const RunResult r = run_cli(dir, "--keep-prepared --seq-len 45 --iters 1 --warmup 0" + extra);
    EXPECT_EQ(r.exit_code, 2) << extra << "\n" << r.out << r.err;
    expect_every_rank_reports(r, "argument '--keep-prepared'");
    EXPECT_EQ(r.out.find("# Avg"), std::string::npos) << "ran anyway:\n" << r.out;
  }
}

// --no-save-t likewise: the CPU path has no T to save or not (a variant and
// dtype that would save one on the GPU, so that this rule is the one refusing).
TEST(RunCli, NoSaveTIsRefusedOnTheCpuPath) {
  TempDir dir;
  const RunResult r = run_cli(dir,
                              "--no-save-t --variant deltanet --dtype bf16 --device cpu "
                              "--seq-len 45 --iters 1 --warmup 0");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "argument '--no-save-t': applies to --device cuda only");
  EXPECT_EQ(r.out.find("# Avg"), std::string::npos) << "ran anyway:\n" << r.out;
}

// And where no T exists (vector gates, additive rules, fp32 inputs) it would
// change nothing: refused, not ignored.
TEST(RunCli, NoSaveTIsRefusedWhereNoTIsSaved) {
  TempDir dir;
  for (const std::string args : {"--variant kda --dtype bf16", "--variant gla --dtype bf16",
                                 "--variant deltanet --dtype f32"}) {
    const RunResult r = run_cli(dir, "--no-save-t " + args + " --seq-len 45 --iters 1 --warmup 0");
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out << r.err;
    expect_every_rank_reports(r, "saves no T");
  }
}

// A shape whose tensors no machine holds is refused naming the flags, not
// by an allocation's exception (std::bad_alloc, exit 3) after the set-up.
TEST(RunCli, ShapeTooLargeIsRefusedNamingTheFlags) {
  TempDir dir;
  const RunResult r =
      run_cli(dir, "--batch 1073741824 --seq-len 1073741824 --no-check --iters 1 --warmup 0");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "argument '--seq-len'");
  EXPECT_NE(r.err.find("--batch 1073741824"), std::string::npos) << r.err;
}

// ---- --variant lact: LactLayer, every chunk split over the ranks ----------------------

constexpr int64_t kLactSeqLen = 48, kLactChunk = 12, kLactHeads = 2, kLactDim = 8, kLactHidden = 16;

const test::LactSizes kLactSizes{1, kLactSeqLen, kLactHeads, kLactDim, kLactHidden};

// The LaCT problem's files, float32 (the values are float32-representable).
void write_lact_inputs(const test::LactProblem& p, const fs::path& dir) {
  const Shape tokens{1, kLactSeqLen, kLactHeads, kLactDim}, rates{1, kLactSeqLen, kLactHeads};
  const Shape wide{kLactHeads, kLactHidden, kLactDim}, narrow{kLactHeads, kLactDim, kLactHidden};
  write_f32(dir / "q.npy", tokens, p.q);
  write_f32(dir / "k.npy", tokens, p.k);
  write_f32(dir / "v.npy", tokens, p.v);
  write_f32(dir / "lr0.npy", rates, p.lr0);
  write_f32(dir / "lr1.npy", rates, p.lr1);
  write_f32(dir / "lr2.npy", rates, p.lr2);
  write_f32(dir / "w0.npy", wide, p.w0);
  write_f32(dir / "w1.npy", narrow, p.w1);
  write_f32(dir / "w2.npy", wide, p.w2);
  write_f32(dir / "do.npy", tokens, p.d_o);
}

// The command-line flags of one LaCT option case.
std::string lact_flags(const test::LactCase& c) {
  const LactConfig cfg = c.config(kLactChunk);
  std::ostringstream os;
  os << "--variant lact --lact-chunk " << kLactChunk << " --lact-hidden " << kLactHidden
     << " --schedule " << to_string(cfg.schedule) << " --momentum " << cfg.momentum
     << " --muon-steps " << cfg.muon_steps << (cfg.renorm ? "" : " --no-renorm");
  return os.str();
}

class RunCliLact : public ::testing::TestWithParam<test::LactCase> {};

TEST_P(RunCliLact, SavedOutputsAndGradientsMatchFp64Reference) {
  const test::LactCase c = GetParam();
  TempDir dir;
  const test::LactProblem problem =
      test::rounded(test::random_lact_problem(kLactSizes, 300 + c.momentum + 2 * c.renorm));
  write_lact_inputs(problem, dir.in());
  const RunResult r = run_cli(dir, lact_flags(c) + " " + io_args(dir), "");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("# Wrong outputs: 0 OK"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("schedule " + std::string(to_string(c.config(kLactChunk).schedule))),
            std::string::npos)
      << r.out;

  const test::LactResult<double> ref = test::run_lact_kernel<double>(problem, c.config(kLactChunk));
  const Shape tokens{1, kLactSeqLen, kLactHeads, kLactDim}, rates{1, kLactSeqLen, kLactHeads};
  const Shape wide{kLactHeads, kLactHidden, kLactDim}, narrow{kLactHeads, kLactDim, kLactHidden};
  const std::pair<std::string, std::pair<Shape, const std::vector<double>*>> expected[] = {
      {"o", {tokens, &ref.o}},      {"dq", {tokens, &ref.dq}},    {"dk", {tokens, &ref.dk}},
      {"dv", {tokens, &ref.dv}},    {"dlr0", {rates, &ref.dlr0}}, {"dlr1", {rates, &ref.dlr1}},
      {"dlr2", {rates, &ref.dlr2}}, {"dw0", {wide, &ref.dw0}},    {"dw1", {narrow, &ref.dw1}},
      {"dw2", {wide, &ref.dw2}},
  };
  std::set<std::string> files;
  for (const auto& [name, want] : expected) files.insert(name + ".npy");
  EXPECT_EQ(files_in(dir.out()), files);
  for (const auto& [name, want] : expected) {
    const double err = rel_rms(read_output(dir, name + ".npy", want.first), *want.second);
    EXPECT_LE(err, kTolerance) << name;
    std::printf("[ lact %s ] %s rel RMS vs fp64 %.2e\n", test::lact_case_name(c).c_str(),
                name.c_str(), err);
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, RunCliLact,
                         ::testing::Values(
                             // (schedule, momentum, muon, renorm)
                             test::LactCase{LactSchedule::apply_then_update, false, false, true},
                             test::LactCase{LactSchedule::apply_then_update, true, true, true},
                             test::LactCase{LactSchedule::apply_then_update, true, true, false},
                             test::LactCase{LactSchedule::update_then_apply, false, false, true},
                             test::LactCase{LactSchedule::update_then_apply, true, true, true},
                             test::LactCase{LactSchedule::update_then_apply, false, false, false}),
                         [](const auto& info) { return test::lact_case_name(info.param); });

TEST(RunCliLactInput, WithoutDoOnlyTheForwardRunsAndOnlyOIsSaved) {
  TempDir dir;
  const test::LactProblem p = test::rounded(test::random_lact_problem(kLactSizes, 43));
  write_lact_inputs(p, dir.in());
  fs::remove(dir.in() / "do.npy");
  const test::LactCase c{LactSchedule::update_then_apply, true, true, true};
  const RunResult r = run_cli(dir, lact_flags(c) + " " + io_args(dir), "");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("pass fwd"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("fwd+bwd"), std::string::npos) << r.out;
  EXPECT_EQ(files_in(dir.out()), std::set<std::string>{"o.npy"});
  const test::LactResult<double> ref =
      test::run_lact_kernel<double>(p, c.config(kLactChunk), /*backward=*/false);
  EXPECT_LE(rel_rms(read_output(dir, "o.npy", {1, kLactSeqLen, kLactHeads, kLactDim}), ref.o),
            kTolerance);
}

TEST(RunCliLactInput, ChunkNotDivisibleByRanksFailsOnEveryRankWithoutWriting) {
  TempDir dir;
  write_lact_inputs(test::rounded(test::random_lact_problem(kLactSizes, 41)), dir.in());
  // Chunks of 10, 10, 10, 10 and 8 tokens: none splits over 3 ranks.
  const RunResult r = run_cli(dir, "--variant lact --lact-chunk 10 " + io_args(dir), "");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "argument '--lact-chunk'");
  // The layout helper's reason (the first chunk that does not split), once:
  // not a second error's prefix and source location inside the message.
  expect_every_rank_reports(r, "ranks: chunk 0 has 10 tokens");
  for (const std::string& err : r.rank_err)
    EXPECT_EQ(err.find("(statescan error"), std::string::npos) << err;
  EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
  EXPECT_EQ(r.out.find("# Wrong"), std::string::npos) << "ran anyway:\n" << r.out;
}

TEST(RunCliLactInput, WrongShapeOfW1FailsNamingTheFile) {
  TempDir dir;
  const test::LactProblem p = test::rounded(test::random_lact_problem(kLactSizes, 42));
  write_lact_inputs(p, dir.in());
  // w1 written as [H, M, D] instead of [H, D, M].
  write_f32(dir.in() / "w1.npy", {kLactHeads, kLactHidden, kLactDim}, p.w1);
  const RunResult r = run_cli(dir, "--variant lact --lact-chunk 12 " + io_args(dir), "");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "w1.npy'");
  EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
}

// A bad value in a loaded LaCT file is named by its file and its index in
// that file, as the mixer's files are (the layer alone saw one rank's slice:
// "argument 'lr1': element 24", an index into that slice).
TEST(RunCliLactInput, BadValuesNameTheFileAndTheirIndexInIt) {
  const test::LactProblem p = test::rounded(test::random_lact_problem(kLactSizes, 44));
  const Shape rates{1, kLactSeqLen, kLactHeads}, tokens{1, kLactSeqLen, kLactHeads, kLactDim};
  {
    TempDir dir;
    write_lact_inputs(p, dir.in());
    std::vector<double> lr1 = p.lr1;
    lr1[2 * 40 + 1] = -1.0;  // token 40, head 1
    write_f32(dir.in() / "lr1.npy", rates, lr1);
    const RunResult r = run_cli(dir, "--variant lact --lact-chunk 12 " + io_args(dir), "");
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    expect_every_rank_reports(r, "lr1.npy element [0, 40, 1] is -1 (learning rates must be");
    EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
  }
  {
    TempDir dir;
    write_lact_inputs(p, dir.in());
    std::vector<double> v = p.v;
    v[(30 * kLactHeads + 0) * kLactDim + 5] = std::nan("");
    write_f32(dir.in() / "v.npy", tokens, v);
    const RunResult r = run_cli(dir, "--variant lact --lact-chunk 12 " + io_args(dir), "");
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    expect_every_rank_reports(r, "v.npy element [0, 30, 0, 5] is nan");
    EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
  }
}

// Learning rates must be > 0: a zero is refused as a negative one is.
TEST(RunCliLactInput, ZeroLearningRateIsRefused) {
  TempDir dir;
  const test::LactProblem p = test::rounded(test::random_lact_problem(kLactSizes, 45));
  write_lact_inputs(p, dir.in());
  std::vector<double> lr0 = p.lr0;
  lr0[2 * 13 + 0] = 0.0;  // token 13, head 0
  write_f32(dir.in() / "lr0.npy", {1, kLactSeqLen, kLactHeads}, lr0);
  const RunResult r = run_cli(dir, "--variant lact --lact-chunk 12 " + io_args(dir), "");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "lr0.npy element [0, 13, 0] is 0 (learning rates must be");
  EXPECT_EQ(files_in(dir.out()), std::set<std::string>{});
}

TEST(RunCliLactInput, MixerChunkFlagIsRefused) {
  TempDir dir;
  const RunResult r = run_cli(dir, "--variant lact --seq-len 48 --lact-chunk 12 --iters 1");
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  expect_every_rank_reports(r, "argument '--chunk'");
}

}  // namespace
}  // namespace statescan
