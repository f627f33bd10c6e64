// Internal status: a kvgc_status code plus the message kvgc_errmsg() will show.
// Cheap when OK (an empty string never allocates).
#pragma once

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "kvgc.h"

namespace kvgc {

// This thread's message of the last fail_fixed (below).
inline thread_local char t_fixed_msg[512];

struct [[nodiscard]] Status {
  kvgc_status code = KVGC_OK;
  std::string msg;
  bool fixed = false;  // the message is t_fixed_msg (fail_fixed), msg is empty

  Status() = default;
  Status(kvgc_status c, std::string m) : code(c), msg(std::move(m)) {}
  bool ok() const { return code == KVGC_OK; }
  static Status Ok() { return {}; }
  std::string_view text() const { return fixed ? std::string_view(t_fixed_msg) : std::string_view(msg); }
};

inline Status fail(kvgc_status c, std::string m) { return Status(c, std::move(m)); }

// A failure whose message is composed without allocating, in this thread's buffer: for
// what an engine meets while it frees memory (a sequence or a prefix already gone), which
// must say KVGC_ENOTFOUND, not KVGC_ENOMEM, when every allocation fails (building a
// std::string message would throw). The buffer holds one message: return the status
// straight to the C API.
__attribute__((format(printf, 2, 3))) inline Status fail_fixed(kvgc_status c, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(t_fixed_msg, sizeof t_fixed_msg, fmt, ap);
  va_end(ap);
  Status st;
  st.code = c;
  st.fixed = true;
  return st;
}

// A C caller may put any int in an enum field; in C++ loading an out-of-range enum is
// undefined (UBSan flags it). Validation reads enum fields through this instead.
template <class E>
int raw_enum(const E& e) {
  static_assert(sizeof(E) == sizeof(int), "C enums are int-sized on supported ABIs");
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

#define KVGC_TRY(expr)                  \
  do {                                  \
    ::kvgc::Status st_ = (expr);        \
    if (!st_.ok()) return st_;          \
  } while (0)

}  // namespace kvgc
