// The real-model tests' guard: 0 when the model file is there; else the exit code the
// test returns: 77 (meson: skipped), or 1 where KVGC_REQUIRE_MODEL=1 (CI: it must run).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

inline int model_missing(const std::string& path, const char* test) {
  if (std::filesystem::exists(path)) return 0;
  const char* require = std::getenv("KVGC_REQUIRE_MODEL");
  std::printf("model %s not found: fetch it with tools/fetch-model.sh (or make model)\n", path.c_str());
  if (require && std::string(require) == "1") return 1;
  std::printf("SKIPPED: %s needs the model\n", test);
  return 77;
}
