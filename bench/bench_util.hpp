// Helpers shared by kvgc's benchmarks: a monotonic timer, a barrier against dead-code
// elimination, a median-of-N runner and the final `RESULT key=value ...` line.
//
// Benchmarks run on shared, noisy machines: they report ratios of things measured side
// by side in one run, and a median of repetitions rather than a single sample.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace kvgc::bench {

// The command line of a benchmark whose one option is --quick (fewer repetitions and
// sizes). Returns -1 to go on, with *quick set; else the exit status to return after the
// usage was printed: 0 for --help (on stdout), 2 for anything else (on stderr).
inline int quick_only_args(int argc, char** argv, bool* quick) {
  *quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      *quick = true;
      continue;
    }
    const bool help = a == "--help";
    if (!help) std::fprintf(stderr, "%s: unknown argument '%s'\n", argv[0], a.c_str());
    std::fprintf(help ? stdout : stderr, "usage: %s [--quick]\n", argv[0]);
    return help ? 0 : 2;
  }
  return -1;
}

// steady_clock: monotonic, and vDSO-backed on Linux, so reading it costs tens of ns.
class Timer {
 public:
  Timer() : start_(Clock::now()) {}
  void restart() { start_ = Clock::now(); }
  double elapsed_ns() const {
    return std::chrono::duration<double, std::nano>(Clock::now() - start_).count();
  }
  double elapsed_s() const { return elapsed_ns() * 1e-9; }

  // What an empty timed interval measures (median of many): subtract it from intervals
  // short enough (a few microseconds) for the two clock reads to matter.
  static double overhead_ns() {
    std::vector<double> samples(1001);
    for (double& s : samples) {
      const Timer t;
      s = t.elapsed_ns();
    }
    std::nth_element(samples.begin(), samples.begin() + 500, samples.end());
    return samples[500];
  }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point start_;
};

// Makes the compiler assume `value` is read (and memory written), so work that produces
// it cannot be dropped or hoisted out of a timed loop.
template <class T>
inline void do_not_optimize(const T& value) {
  asm volatile("" : : "r,m"(value) : "memory");
}

struct Summary {
  double median = NAN;
  double min = NAN;
  double max = NAN;
  int reps = 0;
};

// Calls `rep` `reps` times. Each call returns its own measurement, so it can time only
// what it means to and keep setup, restore and checks outside. The median resists a
// noisy neighbour better than the mean; min and max show how noisy the run was.
template <class Rep>
Summary median_of(int reps, Rep&& rep) {
  std::vector<double> samples;
  samples.reserve(size_t(std::max(reps, 1)));
  for (int i = 0; i < std::max(reps, 1); ++i) samples.push_back(double(rep()));
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  Summary s;
  s.median = n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
  s.min = samples.front();
  s.max = samples.back();
  s.reps = int(n);
  return s;
}

// a / b, or NaN when either side was not measured.
inline double ratio(double a, double b) {
  return std::isfinite(a) && std::isfinite(b) && b != 0 ? a / b : NAN;
}

// The machine-readable last line of a benchmark: `RESULT k1=v1 k2=v2 ...`, in the order
// the keys were added. A value that was not measured prints as `nan`.
class ResultLine {
 public:
  void add(std::string key, double value, int precision = 2) {
    char text[64];
    if (std::isfinite(value))
      std::snprintf(text, sizeof text, "%.*f", precision, value);
    else
      std::snprintf(text, sizeof text, "nan");
    fields_.emplace_back(std::move(key), text);
  }
  std::string str() const {
    std::string line = "RESULT";
    for (const auto& [key, value] : fields_) line += " " + key + "=" + value;
    return line;
  }
  void print() const {
    std::printf("%s\n", str().c_str());
    std::fflush(stdout);
  }

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

}  // namespace kvgc::bench
