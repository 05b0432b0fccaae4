// Status helpers shared by every library. Request errors travel as absl::Status; broken invariants
// are TS_CHECKs that print both operands and abort (they mean a bug, never bad input).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TS_CONCAT_INNER_(a, b) a##b
#define TS_CONCAT_(a, b) TS_CONCAT_INNER_(a, b)

#define TS_RETURN_IF_ERROR(expr)                \
  do {                                          \
    ::absl::Status ts_status_ = (expr);         \
    if (!ts_status_.ok()) return ts_status_;    \
  } while (0)

#define TS_ASSIGN_OR_RETURN(lhs, expr) \
  TS_ASSIGN_OR_RETURN_IMPL_(TS_CONCAT_(ts_statusor_, __LINE__), lhs, expr)
#define TS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(*tmp)

namespace ts::internal {
[[noreturn]] inline void CheckFailed(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  std::abort();
}
template <typename A, typename B>
std::string CheckOpMessage(const char* expr, const A& a, const B& b) {
  std::ostringstream os;
  os << expr << " (" << a << " vs " << b << ")";
  return os.str();
}
}  // namespace ts::internal

#define TS_CHECK(cond)                                                      \
  do {                                                                      \
    if (!(cond)) ::ts::internal::CheckFailed(__FILE__, __LINE__, #cond);    \
  } while (0)

#define TS_CHECK_OP_(a, b, op)                                                         \
  do {                                                                                 \
    const auto& ts_a_ = (a);                                                           \
    const auto& ts_b_ = (b);                                                           \
    if (!(ts_a_ op ts_b_))                                                             \
      ::ts::internal::CheckFailed(                                                     \
          __FILE__, __LINE__, ::ts::internal::CheckOpMessage(#a " " #op " " #b, ts_a_, ts_b_)); \
  } while (0)
#define TS_CHECK_EQ(a, b) TS_CHECK_OP_(a, b, ==)
#define TS_CHECK_NE(a, b) TS_CHECK_OP_(a, b, !=)
#define TS_CHECK_LT(a, b) TS_CHECK_OP_(a, b, <)
#define TS_CHECK_LE(a, b) TS_CHECK_OP_(a, b, <=)
#define TS_CHECK_GT(a, b) TS_CHECK_OP_(a, b, >)
#define TS_CHECK_GE(a, b) TS_CHECK_OP_(a, b, >=)
