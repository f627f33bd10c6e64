// A prompt file, read with a bound (kvgc-run --prompt-file, kvgc-serve FILE): a regular
// file larger than kMaxPromptFileBytes is refused unread; a pipe or a device is read up
// to the bound and refused past it (peak memory: twice the bound at most), so that
// `kvgc-serve /dev/zero` ends with a message instead of growing a line until memory runs
// out (issue 22: 3.1 GB of RSS in 10 s). The bound is far above any prompt a model's
// context holds (a 128K-token context is well under 1 MiB of text).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include <sys/stat.h>

namespace engine {

constexpr size_t kMaxPromptFileBytes = size_t(64) << 20;
constexpr const char* kMaxPromptFileText = "64 MiB";

// The whole file into *out; false with *err naming the file and why (the bound included).
inline bool read_prompt_file(const std::string& path, std::string* out, std::string* err) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    *err = "cannot read '" + path + "': " + std::strerror(errno);
    return false;
  }
  out->clear();
  struct stat st {};
  if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode)) {  // a file: refused unread, or
    if (uint64_t(st.st_size) > kMaxPromptFileBytes) {        // read into its own size
      *err = "'" + path + "' holds " + std::to_string(st.st_size) + " bytes, more than the " +
             kMaxPromptFileText + " a prompt file may hold";
      std::fclose(f);
      return false;
    }
    out->reserve(size_t(st.st_size));
  }
  char buf[1 << 16];
  bool ok = true;
  for (size_t got; (got = std::fread(buf, 1, sizeof buf, f)) > 0;) {
    if (out->size() + got > kMaxPromptFileBytes) {
      *err = "'" + path + "' holds more than " + kMaxPromptFileText +
             ", the most a prompt file may hold (its first " + kMaxPromptFileText +
             " were read, then it was refused)";
      ok = false;
      break;
    }
    out->append(buf, got);
  }
  if (ok && std::ferror(f)) {
    *err = "cannot read '" + path + "': " + std::strerror(errno);
    ok = false;
  }
  std::fclose(f);
  if (!ok) out->clear();
  return ok;
}

}  // namespace engine
