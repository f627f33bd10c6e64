// Internal status: a kvgc_status code plus the message kvgc_errmsg() will show.
// Cheap when OK (an empty string never allocates).
#pragma once

#include <cstring>
#include <string>
#include <utility>

#include "kvgc.h"

namespace kvgc {

struct [[nodiscard]] Status {
  kvgc_status code = KVGC_OK;
  std::string msg;

  Status() = default;
  Status(kvgc_status c, std::string m) : code(c), msg(std::move(m)) {}
  bool ok() const { return code == KVGC_OK; }
  static Status Ok() { return {}; }
};

inline Status fail(kvgc_status c, std::string m) { return Status(c, std::move(m)); }

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
