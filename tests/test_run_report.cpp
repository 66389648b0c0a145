// statescan-run's report (launch/run_report.cpp) on its own, without a run:
// counts that the end-to-end tests (test_run_cli) cannot reach with valid
// inputs, such as a check with exactly one output over the tolerance (a
// mutation that counted only rows with more than one wrong output passed
// every test_run_cli case).
#include <gtest/gtest.h>

#include <string>

#include "launch/run_report.h"

namespace statescan::launch {
namespace {

Report checked_report(std::initializer_list<int> wrong_per_row) {
  Report r;
  r.check.enabled = true;
  r.check.tolerance = 1e-5;
  r.check.errors = {{"o", 2e-6}, {"dq", 3e-5}};
  int64_t step = 0;
  for (int wrong : wrong_per_row) {
    StepRow row;
    row.step = step++;
    row.fwd_ms = 1.0;
    row.bwd_ms = 2.0;
    row.wrong = wrong;
    r.rows.push_back(row);
  }
  return r;
}

TEST(RunReport, TotalWrongSumsTheCheckedRows) {
  EXPECT_EQ(checked_report({}).total_wrong(), 0);
  EXPECT_EQ(checked_report({0, 0}).total_wrong(), 0);
  EXPECT_EQ(checked_report({1}).total_wrong(), 1);
  EXPECT_EQ(checked_report({0, 1, 2}).total_wrong(), 3);
  // < 0: a row that was not checked adds nothing.
  EXPECT_EQ(checked_report({-1, 1}).total_wrong(), 1);
}

// One output over the tolerance fails the report: the footer and the JSON.
TEST(RunReport, OneWrongOutputFailsTheFooterAndTheJson) {
  const Report r = checked_report({0, 1});
  const std::string footer = format_footer(r);
  EXPECT_NE(footer.find("# Wrong outputs: 1 FAILED"), std::string::npos) << footer;
  const std::string json = to_json(r);
  EXPECT_NE(json.find("\"wrong\": 1,"), std::string::npos) << json;
  const std::string ok = format_footer(checked_report({0, 0}));
  EXPECT_NE(ok.find("# Wrong outputs: 0 OK"), std::string::npos) << ok;
}

}  // namespace
}  // namespace statescan::launch
