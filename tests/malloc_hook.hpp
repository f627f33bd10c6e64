// A process-wide malloc the test binary owns: it replaces malloc, calloc, realloc and
// the aligned allocators (operator new reaches them through libstdc++), so *every*
// allocation of the process passes through it: the library's, the C++ runtime's,
// std::thread's, glibc's own. Nothing to do with kvgc's host::allocate hook: this is
// what an outside caller's failing malloc looks like.
//
// Linked only into dedicated binaries (kvgc-oom-sweep, kvgc-parser-peak), never
// with a sanitizer (ASan owns malloc there).
#pragma once

#include <cstddef>
#include <cstdint>

namespace malloc_hook {

// From now on, count allocation attempts (on any thread); attempt `fail_at` (1-based)
// fails, and with `persistent` every later one too. fail_at 0: count, never fail.
void arm(uint64_t fail_at, bool persistent) noexcept;
// Stops counting and failing (verification between calls runs disarmed).
void disarm() noexcept;
// Counting resumes where it stopped (same plan).
void rearm() noexcept;
uint64_t attempts() noexcept;  // since arm()
uint64_t faults() noexcept;    // failures injected since arm()

// Bytes allocated and not freed (malloc_usable_size), process-wide, armed or not, and
// the peak of that since reset_peak().
int64_t live_bytes() noexcept;
int64_t peak_bytes() noexcept;
void reset_peak() noexcept;

}  // namespace malloc_hook
