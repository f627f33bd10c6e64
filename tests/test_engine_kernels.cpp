// The reference engine's kernels: every instruction-set level the CPU has (portable,
// AVX2, AVX-512, AVX-512 VNNI) against a float64 dot product of the dequantised blocks
// with the quantised activations, the f16 conversions bit for bit against the portable
// specification, the activation quantisation against its definition, and the matmul
// thread pool.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/matmul.hpp"
#include "engine/quant.hpp"
#include "engine/thread_pool.hpp"

namespace {

uint16_t random_half(std::mt19937& rng, uint32_t exponent_lo, uint32_t exponent_hi) {
  const uint32_t e = exponent_lo + rng() % (exponent_hi - exponent_lo + 1);
  return uint16_t(((rng() & 1) << 15) | (e << 10) | (rng() & 0x3ff));
}

// Random Q4_1 rows (scales around 2^-5, offsets of either sign).
std::vector<uint8_t> q4_1_rows(std::mt19937& rng, uint32_t rows, uint32_t cols) {
  std::vector<uint8_t> out;
  for (uint32_t b = 0; b < rows * cols / 32; ++b) {
    const uint16_t d = random_half(rng, 8, 12), m = random_half(rng, 8, 13);
    out.push_back(uint8_t(d)), out.push_back(uint8_t(d >> 8));
    out.push_back(uint8_t(m)), out.push_back(uint8_t(m >> 8));
    for (int j = 0; j < 16; ++j) out.push_back(uint8_t(rng()));
  }
  return out;
}

// Random Q8_0 rows, -128 and 127 included.
std::vector<uint8_t> q8_0_rows(std::mt19937& rng, uint32_t rows, uint32_t cols) {
  std::vector<uint8_t> out;
  for (uint32_t b = 0; b < rows * cols / 32; ++b) {
    const uint16_t d = random_half(rng, 6, 10);
    out.push_back(uint8_t(d)), out.push_back(uint8_t(d >> 8));
    for (int j = 0; j < 32; ++j) out.push_back(j == 0 ? 0x80 : j == 1 ? 0x7f : uint8_t(rng()));
  }
  return out;
}

// Activations of mixed scale: some blocks all zero, some tiny, some large.
std::vector<float> activations(std::mt19937& rng, uint32_t n, uint32_t cols) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(n) * cols);
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const int kind = int(rng() % 8);
    const float scale = kind == 0 ? 0.0f : kind == 1 ? 1e-6f : kind == 2 ? 300.0f : 1.0f;
    for (int j = 0; j < 32; ++j) x[b * 32 + j] = scale * normal(rng);
  }
  return x;
}

std::vector<int> levels() {
  std::vector<int> out;
  for (int level = 0; level <= engine::best_kernel_level(); ++level) out.push_back(level);
  return out;
}

}  // namespace

TEST_CASE("engine kernels: activations quantise per block as defined") {
  std::mt19937 rng(3);
  const std::vector<float> x = activations(rng, 3, 96);
  engine::QuantRows q;
  engine::quantize_rows(x.data(), 3, 96, &q);
  REQUIRE(q.n == 3);
  REQUIRE(q.blocks == 3);
  for (size_t b = 0; b < 9; ++b) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b * 32 + j]));
    CHECK(q.d[b] == amax / 127.0f);
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int8_t v = q.q[b * 32 + size_t(j)];
      CHECK(std::abs(int(v)) <= 127);
      if (amax > 0) CHECK(std::fabs(v * q.d[b] - x[b * 32 + j]) <= 0.5f * q.d[b] * 1.0001f);
      sum += v;
    }
    CHECK(q.s[b] == q.d[b] * float(sum));
  }
  // Every level quantises to the same bytes as the portable definition.
  std::vector<float> many = activations(rng, 37, 64);
  many[77] = NAN, many[500] = -INFINITY, many[1000] = 1e38f;
  for (int level : levels()) {
    const engine::Kernels& k = engine::kernels_at(level);
    CAPTURE(k.name);
    const size_t blocks = many.size() / 32;
    std::vector<int8_t> q0(many.size()), q1(many.size());
    std::vector<float> d0(blocks), d1(blocks), s0(blocks), s1(blocks);
    engine::portable::kKernels.quantize(many.data(), blocks, q0.data(), d0.data(), s0.data());
    k.quantize(many.data(), blocks, q1.data(), d1.data(), s1.data());
    CHECK(q0 == q1);
    CHECK(std::memcmp(d0.data(), d1.data(), 4 * blocks) == 0);
    CHECK(std::memcmp(s0.data(), s1.data(), 4 * blocks) == 0);
  }
  // A non-finite value poisons its block's scale (so its products are NaN), not a cast.
  std::vector<float> bad(64, 1.0f);
  bad[40] = INFINITY;
  engine::quantize_rows(bad.data(), 1, 64, &q);
  CHECK(q.d[0] == 1.0f / 127.0f);
  CHECK(std::isnan(q.d[1]));
  CHECK(std::isnan(q.s[1]));
}

TEST_CASE("engine kernels: Q4_1 and Q8_0 products at every level equal the float64 product") {
  std::mt19937 rng(17);
  struct Shape {
    uint32_t rows, cols, n;
  };
  // Odd block counts, rows that are not multiples of the tiles, 1 token (decode) and up
  // to a whole prefill chunk.
  const Shape shapes[] = {{1, 32, 1},  {5, 64, 1},   {7, 96, 3},  {13, 320, 9},
                          {4, 576, 64}, {3, 224, 5}, {9, 160, 4}, {6, 1536, 2}};
  for (int level : levels()) {
    const engine::Kernels& k = engine::kernels_at(level);
    CAPTURE(k.name);
    for (const Shape& s : shapes) {
      CAPTURE(s.rows);
      CAPTURE(s.cols);
      CAPTURE(s.n);
      const std::vector<float> x = activations(rng, s.n, s.cols);
      engine::QuantRows q;
      engine::quantize_rows(x.data(), s.n, s.cols, &q);
      for (const uint32_t type : {engine::kGgmlQ4_1, engine::kGgmlQ8_0}) {
        CAPTURE(type);
        const std::vector<uint8_t> w = type == engine::kGgmlQ4_1 ? q4_1_rows(rng, s.rows, s.cols)
                                                                 : q8_0_rows(rng, s.rows, s.cols);
        const size_t row_bytes = engine::tensor_bytes(type, s.cols);
        std::vector<float> deq(size_t(s.rows) * s.cols);
        std::string err;
        REQUIRE(engine::dequantize(type, w.data(), deq.size(), deq.data(), &err));
        std::vector<float> out(size_t(s.n) * s.rows, NAN);
        (type == engine::kGgmlQ4_1 ? k.q4_1 : k.q8_0)(w.data(), row_bytes, s.rows, q,
                                                      out.data(), s.rows);
        double worst = 0;
        for (uint32_t t = 0; t < s.n; ++t) {
          for (uint32_t r = 0; r < s.rows; ++r) {
            double want = 0, magnitude = 0;
            for (uint32_t i = 0; i < s.cols; ++i) {
              const size_t at = size_t(t) * s.cols + i;
              const double xq = double(q.q[at]) * q.d[at / 32];
              want += double(deq[size_t(r) * s.cols + i]) * xq;
              magnitude += std::fabs(double(deq[size_t(r) * s.cols + i]) * xq);
            }
            const double got = out[size_t(t) * s.rows + r];
            worst = std::max(worst, std::fabs(got - want) / std::max(magnitude, 1e-30));
          }
        }
        // Float sums of up to 48 block products: within n * eps of the terms' magnitude.
        CHECK(worst < 1e-5);
      }
    }
  }
}

TEST_CASE("engine kernels: f32 products and dequantisation at every level") {
  std::mt19937 rng(23);
  const uint32_t rows = 7, cols = 200, n = 3;  // cols not a multiple of 8 or 16
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(rows * cols), x(n * cols);
  for (float& v : w) v = normal(rng);
  for (float& v : x) v = normal(rng);
  const std::vector<uint8_t> q4 = q4_1_rows(rng, 3, 256), q8 = q8_0_rows(rng, 3, 256);
  std::vector<float> want4(3 * 256), want8(3 * 256);
  std::string err;
  REQUIRE(engine::dequantize(engine::kGgmlQ4_1, q4.data(), want4.size(), want4.data(), &err));
  REQUIRE(engine::dequantize(engine::kGgmlQ8_0, q8.data(), want8.size(), want8.data(), &err));
  for (int level : levels()) {
    const engine::Kernels& k = engine::kernels_at(level);
    CAPTURE(k.name);
    std::vector<float> out(n * rows);
    k.f32(w.data(), cols, rows, x.data(), cols, n, cols, out.data(), rows);
    for (uint32_t t = 0; t < n; ++t) {
      for (uint32_t r = 0; r < rows; ++r) {
        double want = 0, magnitude = 0;
        for (uint32_t i = 0; i < cols; ++i) {
          want += double(w[r * cols + i]) * x[t * cols + i];
          magnitude += std::fabs(double(w[r * cols + i]) * x[t * cols + i]);
        }
        CHECK(std::fabs(out[t * rows + r] - want) <= 1e-6 * magnitude);
      }
    }
    std::vector<float> got(3 * 256);
    k.dequant_q4_1(q4.data(), 24, got.data());
    for (size_t i = 0; i < got.size(); ++i)  // an FMA may round d * q + m once, not twice
      CHECK(std::fabs(got[i] - want4[i]) <= 1e-6f * (std::fabs(want4[i]) + 1e-3f));
    k.dequant_q8_0(q8.data(), 24, got.data());
    CHECK(got == want8);
  }
}

TEST_CASE("engine kernels: f16 conversions round to nearest even, bit for bit at every level") {
  // Every half converts to the float it denotes and back to itself (NaNs stay NaN).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = engine::f16_to_f32(uint16_t(h));
    const uint16_t back = engine::f32_to_f16(f);
    if (std::isnan(f)) {
      CHECK((back & 0x7c00) == 0x7c00);
      CHECK((back & 0x3ff) != 0);
    } else {
      CHECK(back == h);
    }
  }
  // Ties and edges: halfway between two halves rounds to the even one; 65520 is the
  // first value that rounds to infinity; 2^-25 ties down to 0, just above it rounds up.
  CHECK(engine::f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
  CHECK(engine::f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);
  CHECK(engine::f32_to_f16(65519.0f) == 0x7bff);
  CHECK(engine::f32_to_f16(65520.0f) == 0x7c00);
  CHECK(engine::f32_to_f16(-1e9f) == 0xfc00);
  CHECK(engine::f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);
  CHECK(engine::f32_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(engine::f32_to_f16(std::ldexp(3.0f, -25)) == 0x0002);
  // Every level's vector conversions equal the portable ones on random floats of every
  // magnitude (subnormal halves, overflow, NaN and infinities included).
  std::mt19937 rng(5);
  std::vector<float> values(4099);
  for (float& v : values) {
    const uint32_t bits = (rng() & 0x80000000u) | ((100 + rng() % 60) << 23) | (rng() & 0x7fffff);
    std::memcpy(&v, &bits, 4);
  }
  values[7] = NAN, values[8] = INFINITY, values[9] = -INFINITY, values[10] = 0.0f;
  values[11] = -0.0f;
  std::vector<uint16_t> want(values.size()), got(values.size());
  engine::portable::kKernels.f32_to_f16(values.data(), values.size(), want.data());
  std::vector<float> want_back(values.size()), got_back(values.size());
  engine::portable::kKernels.f16_to_f32(want.data(), want.size(), want_back.data());
  for (int level : levels()) {
    const engine::Kernels& k = engine::kernels_at(level);
    CAPTURE(k.name);
    k.f32_to_f16(values.data(), values.size(), got.data());
    CHECK(got == want);
    k.f16_to_f32(want.data(), want.size(), got_back.data());
    CHECK(std::memcmp(got_back.data(), want_back.data(), 4 * got_back.size()) == 0);
  }
}

TEST_CASE("engine kernels: a matmul over the pool equals one thread's, chunked or not") {
  std::mt19937 rng(41);
  const uint32_t cols = 128, rows_a = 301, rows_b = 77;
  const std::vector<uint8_t> a = q4_1_rows(rng, rows_a, cols), b = q8_0_rows(rng, rows_b, cols);
  const engine::Matrix wa{engine::kGgmlQ4_1, rows_a, cols, engine::tensor_bytes(engine::kGgmlQ4_1, cols), a.data()};
  const engine::Matrix wb{engine::kGgmlQ8_0, rows_b, cols, engine::tensor_bytes(engine::kGgmlQ8_0, cols), b.data()};
  for (const uint32_t n : {1u, 6u}) {
    const std::vector<float> x = activations(rng, n, cols);
    std::vector<float> one_a(n * rows_a), one_b(n * rows_b), many_a(n * rows_a), many_b(n * rows_b);
    for (const engine::MatmulMode mode : {engine::MatmulMode::Quantized, engine::MatmulMode::Exact}) {
      engine::ThreadPool single(1), pool(3);
      engine::Matmul m1(&single, mode), m3(&pool, mode);
      engine::Activations in;
      in.set(x.data(), n, cols);
      m1.run({{&wa, one_a.data()}, {&wb, one_b.data()}}, in);
      in.set(x.data(), n, cols);
      m3.run({{&wa, many_a.data()}, {&wb, many_b.data()}}, in);
      CHECK(one_a == many_a);  // the same kernel on the same rows: bit-identical
      CHECK(one_b == many_b);
      // The exact path against the float64 product of the dequantised weights.
      if (mode == engine::MatmulMode::Exact) {
        const std::vector<float> deq = engine::dequantize_matrix(wa);
        double worst = 0;
        for (uint32_t t = 0; t < n; ++t)
          for (uint32_t r = 0; r < rows_a; ++r) {
            double want = 0, magnitude = 0;
            for (uint32_t i = 0; i < cols; ++i) {
              want += double(deq[r * cols + i]) * x[t * cols + i];
              magnitude += std::fabs(double(deq[r * cols + i]) * x[t * cols + i]);
            }
            worst = std::max(worst, std::fabs(many_a[t * rows_a + r] - want) / std::max(magnitude, 1e-30));
          }
        CHECK(worst < 1e-6);
      }
    }
  }
}

TEST_CASE("threads: the engine's matmul pool runs every chunk of every job once") {
  for (const uint32_t threads : {1u, 2u, 4u}) {
    engine::ThreadPool pool(threads);
    REQUIRE(pool.size() == threads);
    std::vector<std::atomic<uint32_t>> per_thread(threads);
    for (uint32_t job = 0; job < 3000; ++job) {
      const uint32_t n_chunks = 1 + job % 37;
      std::vector<std::atomic<uint32_t>> hits(n_chunks);
      std::vector<uint32_t> written(n_chunks, 0);  // plain writes, read after run()
      auto work = [&](uint32_t chunk, uint32_t thread) {
        hits[chunk].fetch_add(1, std::memory_order_relaxed);
        written[chunk] = job + 1;
        per_thread[thread].fetch_add(1, std::memory_order_relaxed);
      };
      pool.run(n_chunks, work);
      uint32_t wrong = 0;
      for (uint32_t c = 0; c < n_chunks; ++c) wrong += hits[c].load() != 1 || written[c] != job + 1;
      CHECK(wrong == 0);
      if (job % 7 == 0) pool.rest();  // workers then sleep; the next run wakes them
      if (job % 500 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < threads; ++i) total += per_thread[i].load();
    CHECK(total == 56949);  // sum of 1 + job % 37 over the 3000 jobs
  }
  CHECK(engine::ThreadPool::available_cpus() >= 1);
}

TEST_CASE("threads: a matmul pool destroyed before its workers start still joins them") {
  // Workers that first ran after the destructor's wake-up once waited for another.
  for (int i = 0; i < 300; ++i) {
    engine::ThreadPool pool(4);
    if (i % 2) {
      std::atomic<uint32_t> ran{0};
      auto work = [&](uint32_t, uint32_t) { ran.fetch_add(1); };
      pool.run(5, work);
      CHECK(ran.load() == 5);
    }
  }
}
