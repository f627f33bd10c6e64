// kvgc-run's engine: dequantisation against hand-computed blocks, the byte-level BPE
// tokenizer, and the whole forward pass over a kvgc heap against a naive float64
// dense-attention forward, on a tiny random-weight llama GGUF written here.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../kernels/cpu/convert.hpp"
#include "engine/forward.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "fuzz/tiny_gguf.hpp"
#include "fuzz/tokenizer_reference.hpp"
#include "gguf.hpp"

namespace {

using kvgc_test::byte_tokens;
using kvgc_test::TinyGgufWriter;

// A tiny vocabulary: three control tokens, every byte, and merges spelling "hello",
// " world" and " the".
struct TinyVocab {
  std::vector<std::string> tokens{"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  std::vector<int32_t> types{3, 3, 3};
  std::vector<std::string> merges{"h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or",
                                  "l d", "Ġwor ld", "Ġ t", "Ġt he", "e r"};
  TinyVocab() {
    for (const std::string& b : byte_tokens()) tokens.push_back(b), types.push_back(1);
    for (const std::string& m : merges) {
      const size_t space = m.find(' ');
      const std::string merged = m.substr(0, space) + m.substr(space + 1);
      if (std::find(tokens.begin(), tokens.end(), merged) == tokens.end()) {
        tokens.push_back(merged), types.push_back(1);
      }
    }
  }
};

// What a test changes in the tiny model file: metadata, a tensor left out, retyped or
// reshaped, or every F32 weight huge (logits overflow).
struct Variant {
  uint32_t block_count = 2, embd = 32, heads = 4, kv_heads = 2;
  float rms_eps = 1e-5f;
  std::string drop;        // a tensor left out
  std::string retype;      // a tensor written with type `new_type` (bytes as F32's)
  uint32_t new_type = 0;
  std::string reshape;     // a tensor whose first dim gets +32
  bool all_f32 = false;    // every matrix F32 (token_embd included)
  float huge = 0.0f;       // F32 weights drawn from [-huge, huge] instead of [-0.3, 0.3]
};

// A random-weight llama with 2 layers, embedding 32, 4 heads over 2 KV heads of 8, ffn 48.
// token_embd is Q8_0, two matrices are Q4_1, the rest F32 (unless the variant says).
struct TinyModelFile {
  static constexpr uint32_t kEmbd = 32, kFf = 48, kHeads = 4, kKvHeads = 2, kHeadDim = 8;
  std::mt19937 rng{1234};

  std::string f32_bytes(uint64_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::string out;
    for (uint64_t i = 0; i < n; ++i) TinyGgufWriter::put(&out, dist(rng));
    return out;
  }
  // Random blocks with small f16 scales (exponent field e: about 2^(e-15)).
  std::string q4_1_bytes(uint64_t n) {
    std::string out;
    for (uint64_t b = 0; b < n / 32; ++b) {
      TinyGgufWriter::put(&out, uint16_t((11u << 10) | (rng() & 0x3ff)));            // d
      TinyGgufWriter::put(&out, uint16_t(0x8000u | (13u << 10) | (rng() & 0x3ff)));  // m < 0
      for (int j = 0; j < 16; ++j) out += char(rng() & 0xff);
    }
    return out;
  }
  std::string q8_0_bytes(uint64_t n) {
    std::string out;
    for (uint64_t b = 0; b < n / 32; ++b) {
      TinyGgufWriter::put(&out, uint16_t((7u << 10) | (rng() & 0x3ff)));
      for (int j = 0; j < 32; ++j) out += char(rng() & 0xff);
    }
    return out;
  }

  std::string build(const TinyVocab& vocab, const Variant& v = {}) {
    TinyGgufWriter w;
    w.str("general.architecture", "llama");
    w.u32("llama.block_count", v.block_count);
    w.u32("llama.context_length", 256);
    w.u32("llama.embedding_length", v.embd);
    w.u32("llama.feed_forward_length", kFf);
    w.u32("llama.attention.head_count", v.heads);
    w.u32("llama.attention.head_count_kv", v.kv_heads);
    w.u32("llama.rope.dimension_count", kHeadDim);
    w.f32("llama.rope.freq_base", 10000.0f);
    w.f32("llama.attention.layer_norm_rms_epsilon", v.rms_eps);
    w.str("tokenizer.ggml.model", "gpt2");
    w.str("tokenizer.ggml.pre", "smollm");
    w.strings("tokenizer.ggml.tokens", vocab.tokens);
    w.ints("tokenizer.ggml.token_type", vocab.types);
    w.strings("tokenizer.ggml.merges", vocab.merges);
    w.u32("tokenizer.ggml.bos_token_id", 1);
    w.u32("tokenizer.ggml.eos_token_id", 2);
    const uint64_t n_vocab = vocab.tokens.size();
    const uint64_t q = kHeads * kHeadDim, kv = kKvHeads * kHeadDim;
    const float s = v.huge > 0 ? v.huge : 0.3f;
    auto tensor = [&](const std::string& name, std::vector<uint64_t> dims, uint32_t type) {
      if (name == v.drop) return;
      if (name == v.reshape) dims[0] += 32;
      const uint64_t n = dims.size() == 1 ? dims[0] : dims[0] * dims[1];
      if (v.all_f32 && dims.size() == 2) type = engine::kGgmlF32;
      std::string bytes = type == engine::kGgmlQ8_0   ? q8_0_bytes(n)
                          : type == engine::kGgmlQ4_1 ? q4_1_bytes(n)
                          : dims.size() == 1          ? f32_bytes(n, 0.8f, 1.2f)
                                                      : f32_bytes(n, -s, s);
      if (name == v.retype) type = v.new_type, bytes = f32_bytes(n, -s, s);
      w.tensor(name, dims, type, bytes);
    };
    tensor("token_embd.weight", {kEmbd, n_vocab}, engine::kGgmlQ8_0);
    tensor("output_norm.weight", {kEmbd}, engine::kGgmlF32);
    for (int layer = 0; layer < 2; ++layer) {
      const std::string p = "blk." + std::to_string(layer) + ".";
      tensor(p + "attn_norm.weight", {kEmbd}, engine::kGgmlF32);
      tensor(p + "attn_q.weight", {kEmbd, q}, layer == 1 ? engine::kGgmlQ4_1 : engine::kGgmlF32);
      tensor(p + "attn_k.weight", {kEmbd, kv}, engine::kGgmlF32);
      tensor(p + "attn_v.weight", {kEmbd, kv}, engine::kGgmlF32);
      tensor(p + "attn_output.weight", {q, kEmbd}, engine::kGgmlF32);
      tensor(p + "ffn_norm.weight", {kEmbd}, engine::kGgmlF32);
      tensor(p + "ffn_gate.weight", {kEmbd, kFf}, engine::kGgmlQ4_1);
      tensor(p + "ffn_up.weight", {kEmbd, kFf}, engine::kGgmlF32);
      tensor(p + "ffn_down.weight", {kFf, kEmbd}, engine::kGgmlF32);
    }
    return w.finish();
  }
};

// Writes `bytes` to a temporary GGUF and opens it; removes the file at scope exit.
struct TempGguf {
  std::filesystem::path path;
  gguf::File file;
  TempGguf(const std::string& bytes, const std::string& tag) {
    path = std::filesystem::temp_directory_path() /
           ("kvgc_test_engine_" + tag + "_" + std::to_string(getpid()) + ".gguf");
    std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  }
  bool open(std::string* err) { return file.open(path.string(), err); }
  ~TempGguf() {
    file.close();
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

// The tiny model (a variant of it) written, opened and loaded.
struct TinyModel {
  TempGguf gguf;
  engine::Model model;
  engine::Tokenizer tokenizer;

  explicit TinyModel(const Variant& v = {})
      : gguf(TinyModelFile().build(TinyVocab(), v), "model") {
    std::string err;
    REQUIRE_MESSAGE(gguf.open(&err), err);
    REQUIRE_MESSAGE(engine::load_model(gguf.file, &model, &err), err);
    REQUIRE_MESSAGE(tokenizer.load(gguf.file, &err), err);
  }
};

// The llama forward in float64 with dense causal attention over plain arrays: the last
// token's logits. With `quantize_inputs`, the input of every Q4_1/Q8_0 matmul is first
// rounded as the engine's quantised path rounds it (to float, then 8 bits per block of
// 32), so only the float arithmetic differs from the engine's.
// `probe`, when given, sees every query's probabilities: (layer, query head, query t,
// the probabilities over keys 0..t).
using AttentionProbe =
    std::function<void(size_t layer, size_t head, size_t t, const std::vector<double>& p)>;
std::vector<double> reference_logits(const engine::Model& m, const std::vector<int32_t>& ids,
                                     bool quantize_inputs = false,
                                     const AttentionProbe& probe = nullptr) {
  const engine::Config& c = m.config;
  const size_t n = ids.size(), E = c.n_embd, D = c.head_dim;
  const size_t H = c.n_heads, KV = c.n_kv_heads;
  auto matvec = [&](const engine::Matrix& w, std::vector<double> x) {
    const std::vector<float> dense = engine::dequantize_matrix(w);
    if (quantize_inputs && (w.type == engine::kGgmlQ4_1 || w.type == engine::kGgmlQ8_0)) {
      const std::vector<float> xf(x.begin(), x.end());
      engine::QuantRows q;
      engine::quantize_rows(xf.data(), 1, uint32_t(xf.size()), &q);
      for (size_t i = 0; i < x.size(); ++i) x[i] = double(q.q[i]) * q.d[i / 32];
    }
    std::vector<double> out(w.rows, 0.0);
    for (size_t r = 0; r < w.rows; ++r) {
      for (size_t i = 0; i < w.cols; ++i) out[r] += double(dense[r * w.cols + i]) * x[i];
    }
    return out;
  };
  auto norm = [&](const std::vector<double>& x, const std::vector<float>& w) {
    double sum = 0.0;
    for (double v : x) sum += v * v;
    const double inv = 1.0 / std::sqrt(sum / double(x.size()) + double(c.rms_eps));
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * inv * double(w[i]);
    return out;
  };
  auto rope = [&](std::vector<double>* x, size_t heads, size_t pos) {
    for (size_t h = 0; h < heads; ++h) {
      for (size_t i = 0; i < D / 2; ++i) {
        const double angle = double(pos) * std::pow(double(c.rope_base), -2.0 * i / D);
        double* pair = x->data() + h * D + 2 * i;
        const double a = pair[0], b = pair[1];
        pair[0] = a * std::cos(angle) - b * std::sin(angle);
        pair[1] = a * std::sin(angle) + b * std::cos(angle);
      }
    }
  };
  std::vector<std::vector<double>> x(n, std::vector<double>(E));
  for (size_t t = 0; t < n; ++t) {
    std::vector<float> row(E);
    engine::dequantize_row(m.token_embd, uint32_t(ids[t]), row.data());
    for (size_t i = 0; i < E; ++i) x[t][i] = row[i];
  }
  for (const engine::LayerWeights& w : m.layers) {
    std::vector<std::vector<double>> q(n), k(n), v(n);
    for (size_t t = 0; t < n; ++t) {
      const std::vector<double> xn = norm(x[t], w.attn_norm);
      q[t] = matvec(w.wq, xn);
      k[t] = matvec(w.wk, xn);
      v[t] = matvec(w.wv, xn);
      rope(&q[t], H, t);
      rope(&k[t], KV, t);
    }
    for (size_t t = 0; t < n; ++t) {
      std::vector<double> att(H * D, 0.0);
      for (size_t h = 0; h < H; ++h) {
        const size_t kvh = h / (H / KV);
        std::vector<double> scores(t + 1);
        double top = -INFINITY;
        for (size_t s = 0; s <= t; ++s) {
          double dot = 0.0;
          for (size_t d = 0; d < D; ++d) dot += q[t][h * D + d] * k[s][kvh * D + d];
          scores[s] = dot / std::sqrt(double(D));
          top = std::max(top, scores[s]);
        }
        double total = 0.0;
        for (double& s : scores) total += (s = std::exp(s - top));
        if (probe) {
          std::vector<double> p(scores);
          for (double& x : p) x /= total;
          probe(size_t(&w - m.layers.data()), h, t, p);
        }
        for (size_t s = 0; s <= t; ++s) {
          for (size_t d = 0; d < D; ++d) att[h * D + d] += scores[s] / total * v[s][kvh * D + d];
        }
      }
      const std::vector<double> o = matvec(w.wo, att);
      for (size_t i = 0; i < E; ++i) x[t][i] += o[i];
    }
    for (size_t t = 0; t < n; ++t) {
      const std::vector<double> xn = norm(x[t], w.ffn_norm);
      std::vector<double> g = matvec(w.w_gate, xn);
      const std::vector<double> u = matvec(w.w_up, xn);
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
      const std::vector<double> d = matvec(w.w_down, g);
      for (size_t i = 0; i < E; ++i) x[t][i] += d[i];
    }
  }
  return matvec(m.output_weights(), norm(x[n - 1], m.output_norm));
}

// max |a - b| over max |b|: relative to the logits' scale, so logits near zero do not
// dominate.
double max_relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0.0, scale = 1e-12;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(double(got[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return worst / scale;
}

kvgc_heap_options full_policy_options() {
  kvgc_heap_options opts;
  kvgc_heap_options_init(&opts);
  opts.policy = KVGC_POLICY_FULL;
  opts.device = KVGC_DEVICE_CPU;
  opts.flags = KVGC_OPT_IGNORE_ENV;
  opts.budget_bytes = 64ull << 20;
  return opts;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Inputs for tokenizer comparisons: the vendored texts, random bytes, random text over a
// small alphabet (where random vocabularies merge deeply) with special tokens mixed in,
// and long single pieces.
std::vector<std::string> tokenizer_inputs() {
  std::vector<std::string> out;
  for (const char* path : {KVGC_QUALITY_DATA_DIR "/jargon-intro.txt",
                           KVGC_QUALITY_DATA_DIR "/gpl-3.txt", KVGC_TEST_DATA_DIR "/passage.txt"}) {
    out.push_back(read_text(path));
    REQUIRE_MESSAGE(out.back().size() > 1000, path);
  }
  std::mt19937 rng(99);
  for (int i = 0; i < 300; ++i) {
    std::string bytes(rng() % 300, '\0');
    for (char& c : bytes) c = char(rng() & 0xff);
    out.push_back(bytes);
  }
  const std::string alphabet = "abcde 01\n\t'";
  for (int i = 0; i < 300; ++i) {
    std::string text;
    const size_t n = rng() % 400;
    while (text.size() < n) {
      if (rng() % 50 == 0) text += rng() % 2 ? "<|im_start|>" : "<|im_end|>";
      text += alphabet[rng() % alphabet.size()];
    }
    out.push_back(text);
  }
  out.push_back(std::string(3000, 'a'));
  out.push_back(std::string(2000, ' '));
  std::string ab;
  for (int i = 0; i < 1500; ++i) ab += "ab";
  out.push_back(ab);
  return out;
}

}  // namespace

TEST_CASE("engine: Q4_1, Q8_0 and F16 dequantise as ggml defines them") {
  // Q4_1: d = 0.5 (f16 0x3800), m = -1 (0xbc00); byte j holds j (low) and 15 - j (high).
  std::string q4;
  TinyGgufWriter::put(&q4, uint16_t(0x3800));
  TinyGgufWriter::put(&q4, uint16_t(0xbc00));
  for (int j = 0; j < 16; ++j) q4 += char(j | ((15 - j) << 4));
  std::vector<float> out(32);
  std::string err;
  REQUIRE(engine::dequantize(engine::kGgmlQ4_1, reinterpret_cast<const uint8_t*>(q4.data()), 32,
                             out.data(), &err));
  for (int j = 0; j < 16; ++j) {
    CHECK(out[size_t(j)] == doctest::Approx(0.5 * j - 1.0));
    CHECK(out[size_t(j) + 16] == doctest::Approx(0.5 * (15 - j) - 1.0));
  }
  // Q8_0: d = 0.25 (0x3400), q_j = j - 16.
  std::string q8;
  TinyGgufWriter::put(&q8, uint16_t(0x3400));
  for (int j = 0; j < 32; ++j) q8 += char(int8_t(j - 16));
  REQUIRE(engine::dequantize(engine::kGgmlQ8_0, reinterpret_cast<const uint8_t*>(q8.data()), 32,
                             out.data(), &err));
  for (int j = 0; j < 32; ++j) CHECK(out[size_t(j)] == doctest::Approx(0.25 * (j - 16)));

  CHECK(engine::f16_to_f32(0x3c00) == 1.0f);
  CHECK(engine::f16_to_f32(0xc000) == -2.0f);
  CHECK(engine::f16_to_f32(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(engine::f16_to_f32(0x7bff) == 65504.0f);
  CHECK(std::isinf(engine::f16_to_f32(0x7c00)));

  CHECK_FALSE(engine::dequantize(12, reinterpret_cast<const uint8_t*>(q8.data()), 32,
                                 out.data(), &err));
  CHECK(err.find("Q4_K") != std::string::npos);
  CHECK(engine::tensor_bytes(engine::kGgmlQ4_1, 64) == 40);
  CHECK(engine::tensor_bytes(engine::kGgmlQ8_0, 33) == 0);  // not whole blocks
}

TEST_CASE("engine: pre-tokenizer splits as GPT-2 with SmolLM's single digits") {
  using V = std::vector<std::string>;
  CHECK(engine::pre_tokenize("Hello world's end", false) == V{"Hello", " world", "'s", " end"});
  CHECK(engine::pre_tokenize("a  b\n\nc  ", false) == V{"a", " ", " b", "\n", "\n", "c", "  "});
  CHECK(engine::pre_tokenize("x=1234!?", false) == V{"x", "=", "1234", "!?"});
  CHECK(engine::pre_tokenize("x 1234", true) == V{"x", " ", "1", "2", "3", "4"});
  CHECK(engine::pre_tokenize("café ünï", false) == V{"café", " ünï"});
}

TEST_CASE("engine: byte-level BPE encodes, decodes and recognises special tokens") {
  TinyModel tiny;
  const engine::Tokenizer& tok = tiny.tokenizer;
  const int32_t hello = tok.find("hello"), world = tok.find("Ġworld");
  REQUIRE(hello >= 0);
  REQUIRE(world >= 0);
  CHECK(tok.encode("hello world") == std::vector<int32_t>{hello, world});
  CHECK(tok.bos() == 1);
  CHECK(tok.eos() == 2);

  for (const std::string text : {"hello world, the weather 2024!", "  tabs\tand\nnewlines  ",
                                 "héllo wörld ✓ 日本語 😀", ""}) {
    CAPTURE(text);
    CHECK(tok.decode(tok.encode(text)) == text);
  }
  const std::vector<int32_t> chat = tok.encode("<|im_start|>user\nhello<|im_end|>\n");
  REQUIRE(chat.size() >= 4);
  CHECK(chat.front() == tok.find("<|im_start|>"));
  CHECK(chat[chat.size() - 2] == tok.find("<|im_end|>"));
  CHECK(std::count(chat.begin(), chat.end(), hello) == 1);
  CHECK(tok.decode(chat) == "<|im_start|>user\nhello<|im_end|>\n");
  // Without special parsing the markers are plain text, encoded byte by byte.
  const std::vector<int32_t> plain = tok.encode("<|im_end|>", false);
  CHECK(plain.size() > 1);
  CHECK(tok.decode(plain) == "<|im_end|>");

  CHECK(engine::apply_chat_template({{"user", "hi"}}, true) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}

TEST_CASE("engine: the priority-queue BPE equals the rescanning reference, token for token") {
  const std::vector<std::string> inputs = tokenizer_inputs();
  const TinyVocab tiny;
  struct Case {
    const char* name;
    kvgc_test::Vocab vocab;
  } cases[] = {{"tiny", {tiny.tokens, tiny.types, tiny.merges}},
               {"random 400", kvgc_test::random_vocab(1, 400)},
               {"random 1500", kvgc_test::random_vocab(2, 1500)}};
  for (const Case& c : cases) {
    CAPTURE(c.name);
    TempGguf gguf(kvgc_test::vocab_gguf(c.vocab), "vocab");
    std::string err;
    REQUIRE_MESSAGE(gguf.open(&err), err);
    engine::Tokenizer tok;
    kvgc_test::ReferenceTokenizer ref;
    REQUIRE_MESSAGE(tok.load(gguf.file, &err), err);
    REQUIRE(ref.load(gguf.file));
    size_t compared = 0, differ = 0, tokens = 0, first_differ = SIZE_MAX;
    for (size_t i = 0; i < inputs.size(); ++i) {
      for (const bool special : {false, true}) {
        const std::vector<int32_t> got = tok.encode(inputs[i], special);
        ++compared;
        tokens += got.size();
        if (got != ref.encode(inputs[i], special)) {
          ++differ;
          first_differ = std::min(first_differ, i);
        }
      }
    }
    CAPTURE(first_differ);
    CHECK(differ == 0);
    CHECK(compared == 2 * inputs.size());
    MESSAGE(std::string(c.name) << ": " << compared << " encodings, " << tokens << " tokens compared");
  }
}

// Tolerances, as max |error| over max |logit|:
// - exact matmuls, f32 K/V: only float rounding (sums of a few dozen products): 1e-4;
// - f16 K/V adds the rounding of q, k, v and the attention output to 11 bits (2^-12
//   relative each, compounded over 2 layers): 2e-3;
// - quantised activations against a reference that rounds its inputs the same way: the
//   same float rounding, except where upstream float noise moves an activation across a
//   rounding boundary (one step, d = max/127, in one element of a 32-block): 2e-3;
// - quantised activations against the unrounded reference: each activation is off by up
//   to d/2, which is max|x|/254 of its block (0.4% of the largest): measured 0.5-1.2% on
//   this model, bound 3e-2.
TEST_CASE("engine: forward over a kvgc heap matches a float64 dense-attention forward") {
  struct Config {
    const char* name;
    Variant variant;
    engine::MatmulMode matmul;
    kvgc_dtype kv;
    bool reference_quantizes;
    double tolerance;
  };
  Variant all_f32;
  all_f32.all_f32 = true;
  const Config configs[] = {
      {"all F32 weights, f32 K/V", all_f32, engine::MatmulMode::Quantized, KVGC_DTYPE_F32, false, 1e-4},
      {"exact matmuls, f32 K/V", {}, engine::MatmulMode::Exact, KVGC_DTYPE_F32, false, 1e-4},
      {"exact matmuls, f16 K/V", {}, engine::MatmulMode::Exact, KVGC_DTYPE_F16, false, 2e-3},
      {"q8 activations, f32 K/V, rounding reference", {}, engine::MatmulMode::Quantized, KVGC_DTYPE_F32, true, 2e-3},
      {"q8 activations, f32 K/V", {}, engine::MatmulMode::Quantized, KVGC_DTYPE_F32, false, 3e-2},
      {"q8 activations, f16 K/V (the default)", {}, engine::MatmulMode::Quantized, KVGC_DTYPE_F16, false, 3e-2},
  };
  for (const Config& config : configs) {
    CAPTURE(config.name);
    TinyModel tiny(config.variant);
    const engine::Config& c = tiny.model.config;
    REQUIRE(c.n_layers == 2);
    REQUIRE(c.n_heads == 4);
    REQUIRE(c.n_kv_heads == 2);
    REQUIRE(c.head_dim == 8);
    CHECK(tiny.model.output.data == nullptr);  // tied to token_embd

    const std::vector<int32_t> ids =
        tiny.tokenizer.encode("<|im_start|>user\nhello world, the 42 é!<|im_end|>\n");
    REQUIRE(ids.size() >= 18);
    REQUIRE(ids.size() <= 30);
    const std::vector<double> want = reference_logits(tiny.model, ids, config.reference_quantizes);
    const kvgc_heap_options opts = full_policy_options();
    engine::EngineOptions eopts;
    eopts.matmul = config.matmul;
    eopts.kv_dtype = config.kv;
    std::string err;

    for (const uint32_t threads : {1u, 3u}) {
      CAPTURE(threads);
      eopts.threads = threads;
      engine::Engine chunk;
      REQUIRE_MESSAGE(chunk.init(tiny.model, &opts, &err, eopts), err);
      CHECK(chunk.kv_model().dtype == config.kv);
      CHECK(chunk.options().threads == threads);
      std::vector<float> logits(c.n_vocab);
      REQUIRE_MESSAGE(chunk.forward(ids.data(), uint32_t(ids.size()), logits.data(), &err), err);
      CHECK(chunk.position() == ids.size());
      const double chunk_error = max_relative_error(logits, want);
      CHECK(chunk_error <= config.tolerance);

      // Prefill, then token-by-token decode: the same logits.
      engine::Engine decode;
      REQUIRE_MESSAGE(decode.init(tiny.model, &opts, &err, eopts), err);
      const uint32_t prefill = uint32_t(ids.size()) - 5;
      REQUIRE_MESSAGE(decode.forward(ids.data(), prefill, nullptr, &err), err);
      for (size_t t = prefill; t < ids.size(); ++t) {
        REQUIRE_MESSAGE(decode.forward(&ids[t], 1, logits.data(), &err), err);
      }
      const double decode_error = max_relative_error(logits, want);
      CHECK(decode_error <= config.tolerance);
      MESSAGE(config.name << ", " << threads << " thread(s): max relative error " << chunk_error
                          << " (one chunk), " << decode_error << " (decode)");

      kvgc_stats stats;
      kvgc_stats_init(&stats);
      REQUIRE(kvgc_get_stats(decode.heap(), &stats) == KVGC_OK);
      CHECK(stats.live_tokens == ids.size() * c.n_layers);  // policy full keeps everything
      CHECK(stats.steps == 6);
    }
  }
}

// Each layer's scores and positions after an observe prefill, in position order.
std::vector<std::vector<float>> observed_scores(engine::Engine& e, uint32_t layers) {
  std::vector<std::vector<float>> out(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    uint64_t n = 0;
    REQUIRE(kvgc_read_scores(e.heap(), e.sequence(), l, nullptr, nullptr, 0, &n, nullptr) == KVGC_OK);
    std::vector<float> scores(n);
    std::vector<int32_t> pos(n);
    REQUIRE(kvgc_read_scores(e.heap(), e.sequence(), l, scores.data(), nullptr, n, &n, nullptr) == KVGC_OK);
    REQUIRE(kvgc_read(e.heap(), e.sequence(), l, nullptr, nullptr, pos.data(), n, &n, nullptr) == KVGC_OK);
    out[l].assign(n, -1.0f);
    for (uint64_t i = 0; i < n; ++i) out[l].at(size_t(pos[i])) = scores[i];
  }
  return out;
}

TEST_CASE("engine: the observe prefill pools each score over pool_radius positions either side") {
  TinyModel tiny;
  const uint32_t layers = tiny.model.config.n_layers;
  const std::vector<int32_t> ids = tiny.tokenizer.encode(
      "<|im_start|>user\nthe pass key is 71432, remember 71432 and the rest is filler text "
      "that goes on and on until the question. What is the pass key?<|im_end|>\n");
  REQUIRE(ids.size() > engine::Engine::kObserveTokens + 8);  // some tokens do not score
  const kvgc_heap_options opts = full_policy_options();
  std::string err;
  auto prefill = [&](uint32_t radius) {
    engine::EngineOptions eo;
    eo.threads = 1;
    eo.pool_radius = radius;
    auto e = std::make_unique<engine::Engine>();
    REQUIRE_MESSAGE(e->init(tiny.model, &opts, &err, eo), err);
    std::vector<float> logits(tiny.model.config.n_vocab);
    REQUIRE_MESSAGE(e->prefill(ids.data(), uint32_t(ids.size()), logits.data(), &err,
                               engine::Engine::PrefillMode::Observe), err);
    return observed_scores(*e, layers);
  };
  const auto raw = prefill(0);
  for (const uint32_t radius : {1u, 3u, 5u, 8u}) {
    CAPTURE(radius);
    const auto pooled = prefill(radius);
    size_t raised = 0;
    for (uint32_t l = 0; l < layers; ++l) {
      const std::vector<float>& r = raw[l];
      REQUIRE(pooled[l].size() == r.size());
      for (size_t p = 0; p < r.size(); ++p) {
        float best = r[p];
        for (size_t q = p >= radius ? p - radius : 0; q <= std::min(r.size() - 1, p + radius); ++q)
          best = std::max(best, r[q]);
        CHECK(pooled[l][p] == doctest::Approx(best).epsilon(1e-6));
        raised += best > r[p];
      }
    }
    CHECK(raised > 0);  // a neighbour's score was taken somewhere
  }
  engine::EngineOptions too_wide;
  too_wide.pool_radius = engine::kMaxPoolRadius + 1;
  engine::Engine e;
  CHECK_FALSE(e.init(tiny.model, &opts, &err, too_wide));
  CHECK(err.find("pool_radius") != std::string::npos);
}

TEST_CASE("engine: key_prior adds each prefilled key's diversity, scaled to the observed mass") {
  TinyModel tiny;
  const engine::Config& c = tiny.model.config;
  const std::vector<int32_t> ids = tiny.tokenizer.encode(
      "<|im_start|>user\nthe pass key is 71432, remember 71432 and the rest is filler text "
      "that goes on and on until the question. What is the pass key?<|im_end|>\n");
  const kvgc_heap_options opts = full_policy_options();
  std::string err;
  for (const kvgc_dtype kv : {KVGC_DTYPE_F32, KVGC_DTYPE_F16}) {
    CAPTURE(int(kv));
    auto prefill = [&](float weight) {
      engine::EngineOptions eo;
      eo.threads = 1;
      eo.pool_radius = 0;
      eo.kv_dtype = kv;
      eo.key_prior = weight;
      auto e = std::make_unique<engine::Engine>();
      REQUIRE_MESSAGE(e->init(tiny.model, &opts, &err, eo), err);
      std::vector<float> logits(c.n_vocab);
      REQUIRE_MESSAGE(e->prefill(ids.data(), uint32_t(ids.size()), logits.data(), &err,
                                 engine::Engine::PrefillMode::Observe), err);
      return e;
    };
    const auto plain = prefill(0.0f), with = prefill(0.5f);
    const auto base = observed_scores(*plain, c.n_layers);
    const auto got = observed_scores(*with, c.n_layers);
    const uint32_t width = c.n_kv_heads * c.head_dim;
    for (uint32_t l = 0; l < c.n_layers; ++l) {
      // The reference: f32 keys read back, per head 1 - cos to the mean unit key.
      const uint64_t n = ids.size();
      std::vector<float> k(n * width);
      std::vector<uint16_t> k16(n * width);
      std::vector<int32_t> pos(n);
      uint64_t got_n = 0;
      void* out = kv == KVGC_DTYPE_F32 ? static_cast<void*>(k.data()) : k16.data();
      REQUIRE(kvgc_read(plain->heap(), plain->sequence(), l, out, nullptr, pos.data(), n, &got_n,
                        nullptr) == KVGC_OK);
      REQUIRE(got_n == n);
      if (kv == KVGC_DTYPE_F16)
        for (size_t i = 0; i < k.size(); ++i) k[i] = kvgc::cpu::f16_to_f32(k16[i]);
      std::vector<double> diversity(n, 0.0);
      double total = 0;
      for (uint32_t h = 0; h < c.n_kv_heads; ++h) {
        std::vector<double> mean(c.head_dim, 0.0);
        auto unit = [&](uint64_t i, uint32_t d) {
          const float* x = &k[i * width + h * c.head_dim];
          double norm = 0;
          for (uint32_t j = 0; j < c.head_dim; ++j) norm += double(x[j]) * x[j];
          return x[d] / std::sqrt(norm);
        };
        for (uint64_t i = 0; i < n; ++i)
          for (uint32_t d = 0; d < c.head_dim; ++d) mean[d] += unit(i, d);
        double norm = 0;
        for (const double m : mean) norm += m * m;
        for (uint64_t i = 0; i < n; ++i) {
          double dot = 0;
          for (uint32_t d = 0; d < c.head_dim; ++d) dot += unit(i, d) * mean[d] / std::sqrt(norm);
          diversity[size_t(pos[i])] += 1 - dot;
          total += 1 - dot;
        }
      }
      const double mass = double(engine::Engine::kObserveTokens) * c.n_heads;
      double added = 0;
      for (uint64_t p = 0; p < n; ++p) {
        CAPTURE(l);
        CAPTURE(p);
        CHECK(got[l][p] - base[l][p] ==
              doctest::Approx(0.5 * mass * diversity[p] / total).epsilon(1e-3).scale(1e-3));
        added += got[l][p] - base[l][p];
      }
      CHECK(added == doctest::Approx(0.5 * mass).epsilon(1e-3));
    }
  }
  engine::EngineOptions bad;
  for (const float weight : {-1.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    bad.key_prior = weight;
    engine::Engine e;
    CHECK_FALSE(e.init(tiny.model, &opts, &err, bad));
    CHECK(err.find("key_prior") != std::string::npos);
  }
}

// The reconstruction tests' prompt and repeat instruction, in the tiny model's tokens.
struct ReconstructPrompt {
  std::vector<int32_t> ids, repeat;
  explicit ReconstructPrompt(const TinyModel& tiny)
      : ids(tiny.tokenizer.encode(
            "<|im_start|>user\nthe pass key is 71432, remember 71432 and the rest is filler "
            "text that goes on and on until the question ends the context here")),
        repeat(tiny.tokenizer.encode("\n\nrepeat the text", false)) {}
};

TEST_CASE("engine: the reconstruction signal is each token's peak mass over the repeat's queries") {
  TinyModel tiny;
  const engine::Config& c = tiny.model.config;
  const ReconstructPrompt prompt(tiny);
  const std::vector<int32_t>& ids = prompt.ids;
  const std::vector<int32_t>& repeat = prompt.repeat;
  const uint32_t n = uint32_t(ids.size());
  const kvgc_heap_options opts = full_policy_options();
  std::string err;
  for (const kvgc_dtype kv : {KVGC_DTYPE_F32, KVGC_DTYPE_F16}) {
    CAPTURE(int(kv));
    auto options = [&](float weight, uint32_t chunk) {
      engine::EngineOptions eo;
      eo.threads = 1;
      eo.pool_radius = 0;
      eo.kv_dtype = kv;
      eo.reconstruct = weight;
      eo.reconstruct_prompt = repeat;
      eo.reconstruct_chunk = chunk;
      eo.reconstruct_across_layers = false;  // each layer's own (the across case below)
      return eo;
    };
    auto prefill = [&](const engine::EngineOptions& eo) {
      auto e = std::make_unique<engine::Engine>();
      REQUIRE_MESSAGE(e->init(tiny.model, &opts, &err, eo), err);
      std::vector<float> logits(c.n_vocab);
      REQUIRE_MESSAGE(e->prefill(ids.data(), n, logits.data(), &err,
                                 engine::Engine::PrefillMode::Observe), err);
      return e;
    };
    // The reference: the repeat run on the prompt's own sequence one query at a time,
    // each token's largest gain in score less its mean gain.
    const auto ref = prefill(options(0, n));
    const auto base = observed_scores(*ref, c.n_layers);
    std::vector<std::vector<double>> peak(c.n_layers, std::vector<double>(n, 0.0));
    std::vector<std::vector<float>> last = base;
    std::vector<int32_t> rows = repeat;
    rows.insert(rows.end(), ids.begin(), ids.end());
    engine::Engine::Pass no_step;
    no_step.step = false;
    for (const int32_t token : rows) {
      REQUIRE_MESSAGE(ref->forward(&token, 1, nullptr, &err, no_step), err);
      const auto now = observed_scores(*ref, c.n_layers);
      for (uint32_t l = 0; l < c.n_layers; ++l)
        for (uint32_t p = 0; p < n; ++p) {
          peak[l][p] = std::max(peak[l][p], double(now[l][p]) - last[l][p]);
          last[l][p] = now[l][p];
        }
    }
    auto plain = prefill(options(0, n));
    engine::Engine::LayerMass mass;
    REQUIRE_MESSAGE(plain->reconstruction_mass(plain->sequence(), 0, ids.data(), n, &mass, &err), err);
    REQUIRE(mass.size() == c.n_layers);
    for (uint32_t l = 0; l < c.n_layers; ++l) {
      REQUIRE(mass[l].size() == n);
      for (uint32_t p = 0; p < n; ++p) {
        CAPTURE(l);
        CAPTURE(p);
        const double mean = (double(last[l][p]) - base[l][p]) / double(rows.size());
        CHECK(mass[l][p] == doctest::Approx(std::max(0.0, peak[l][p] - mean)).epsilon(1e-3).scale(1e-4));
      }
    }
    // The forks are gone and the prompt's own cache is as it was.
    kvgc_stats stats;
    kvgc_stats_init(&stats);
    REQUIRE(kvgc_get_stats(plain->heap(), &stats) == KVGC_OK);
    CHECK(stats.sequences == 1);
    CHECK(stats.live_tokens == uint64_t(n) * c.n_layers);
    CHECK(observed_scores(*plain, c.n_layers) == base);
    CHECK(kvgc_heap_check(plain->heap()) == KVGC_OK);

    // Chunked (several forks): each token's mass is its own chunk's, every fork gone.
    engine::Engine::LayerMass chunked;
    auto small = prefill(options(0, 7));
    REQUIRE_MESSAGE(small->reconstruction_mass(small->sequence(), 0, ids.data(), n, &chunked, &err), err);
    REQUIRE(kvgc_get_stats(small->heap(), &stats) == KVGC_OK);
    CHECK(stats.sequences == 1);
    double chunked_total = 0;
    for (const auto& layer : chunked)
      for (const float m : layer) chunked_total += m;
    CHECK(chunked_total > 0);

    // The prefill with a weight: the scores gain the mass, sinks none, scaled to W times
    // what the observed queries paid; then the same pages as without it.
    const float weight = 2.0f;
    const auto with = prefill(options(weight, n));
    const auto got = observed_scores(*with, c.n_layers);
    const double paid = double(std::min(n, engine::Engine::kObserveTokens)) * c.n_heads;
    for (uint32_t l = 0; l < c.n_layers; ++l) {
      double total = 0, added = 0;
      for (uint32_t p = opts.sinks; p < n; ++p) total += mass[l][p];
      for (uint32_t p = 0; p < n; ++p) {
        CAPTURE(l);
        CAPTURE(p);
        const double want = p < opts.sinks ? 0.0 : weight * paid * mass[l][p] / total;
        CHECK(got[l][p] - base[l][p] == doctest::Approx(want).epsilon(1e-3).scale(1e-3));
        added += got[l][p] - base[l][p];
      }
      CHECK(added == doctest::Approx(weight * paid).epsilon(1e-3));
    }
    // Across layers: every layer gains the mean of the layers' shares, scaled alike.
    engine::EngineOptions across = options(weight, n);
    across.reconstruct_across_layers = true;
    const auto shared = observed_scores(*prefill(across), c.n_layers);
    std::vector<double> share(n, 0.0);
    for (uint32_t l = 0; l < c.n_layers; ++l) {
      double total = 0;
      for (uint32_t p = opts.sinks; p < n; ++p) total += mass[l][p];
      for (uint32_t p = opts.sinks; p < n; ++p) share[p] += mass[l][p] / total;
    }
    const double shares = double(c.n_layers);  // each layer's shares sum to 1
    for (uint32_t l = 0; l < c.n_layers; ++l)
      for (uint32_t p = 0; p < n; ++p) {
        CAPTURE(l);
        CAPTURE(p);
        CHECK(shared[l][p] - base[l][p] ==
              doctest::Approx(weight * paid * share[p] / shares).epsilon(1e-3).scale(1e-3));
      }
  }
  engine::EngineOptions bad;
  for (const float weight : {-1.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    bad.reconstruct = weight;
    engine::Engine e;
    CHECK_FALSE(e.init(tiny.model, &opts, &err, bad));
    CHECK(err.find("reconstruct ") != std::string::npos);
  }
  bad.reconstruct = 1;
  bad.reconstruct_chunk = 0;
  engine::Engine e1;
  CHECK_FALSE(e1.init(tiny.model, &opts, &err, bad));
  CHECK(err.find("reconstruct_chunk") != std::string::npos);
  bad.reconstruct_chunk = 8;
  bad.reconstruct_rows = 0;
  engine::Engine e2;
  CHECK_FALSE(e2.init(tiny.model, &opts, &err, bad));
  CHECK(err.find("reconstruct_rows") != std::string::npos);
}

TEST_CASE("engine: the head-peak reconstruction signal is each token's largest probability "
          "over the repeat's queries and heads") {
  TinyModel tiny;
  const engine::Config& c = tiny.model.config;
  const ReconstructPrompt prompt(tiny);
  const std::vector<int32_t>& ids = prompt.ids;
  const std::vector<int32_t>& repeat = prompt.repeat;
  const size_t n = ids.size();
  std::vector<int32_t> all = ids;
  all.insert(all.end(), repeat.begin(), repeat.end());
  all.insert(all.end(), ids.begin(), ids.end());
  // The reference: the float64 forward over prompt + repeat + prompt, each prompt token's
  // largest probability from any query head of a KV head's group, over the repeat's queries.
  const size_t group = c.n_heads / c.n_kv_heads;
  std::vector<std::vector<double>> want(c.n_layers, std::vector<double>(c.n_kv_heads * n, 0.0));
  reference_logits(tiny.model, all, false,
                   [&](size_t layer, size_t head, size_t t, const std::vector<double>& p) {
                     if (t < n) return;
                     for (size_t s = 0; s < n; ++s) {
                       double& w = want[layer][head / group * n + s];
                       w = std::max(w, p[s]);
                     }
                   });
  REQUIRE(c.n_kv_heads > 1);  // the per-head split is tested
  REQUIRE(group > 1);
  const kvgc_heap_options opts = full_policy_options();
  std::string err;
  for (const uint32_t threads : {1u, 2u}) {
    CAPTURE(threads);
    engine::EngineOptions eo;
    eo.threads = threads;
    eo.pool_radius = 0;
    eo.kv_dtype = KVGC_DTYPE_F32;
    eo.matmul = engine::MatmulMode::Exact;
    eo.reconstruct_prompt = repeat;
    eo.reconstruct_chunk = uint32_t(n);
    eo.reconstruct_head_peak = true;
    engine::Engine e;
    REQUIRE_MESSAGE(e.init(tiny.model, &opts, &err, eo), err);
    std::vector<float> logits(c.n_vocab);
    REQUIRE_MESSAGE(e.prefill(ids.data(), uint32_t(n), logits.data(), &err,
                              engine::Engine::PrefillMode::Observe), err);
    const auto before = observed_scores(e, c.n_layers);
    engine::Engine::LayerMass heads, mass;
    REQUIRE_MESSAGE(e.reconstruction_head_peaks(e.sequence(), 0, ids.data(), uint32_t(n), &heads, &err), err);
    REQUIRE_MESSAGE(e.reconstruction_mass(e.sequence(), 0, ids.data(), uint32_t(n), &mass, &err), err);
    REQUIRE(heads.size() == c.n_layers);
    REQUIRE(mass.size() == c.n_layers);
    for (uint32_t l = 0; l < c.n_layers; ++l) {
      REQUIRE(heads[l].size() == c.n_kv_heads * n);
      REQUIRE(mass[l].size() == n);
      for (size_t p = 0; p < n; ++p) {
        CAPTURE(l);
        CAPTURE(p);
        double top = 0;
        for (size_t g = 0; g < c.n_kv_heads; ++g) {
          CAPTURE(g);
          CHECK(heads[l][g * n + p] == doctest::Approx(want[l][g * n + p]).epsilon(1e-3).scale(1e-4));
          top = std::max(top, want[l][g * n + p]);
        }
        CHECK(mass[l][p] == doctest::Approx(top).epsilon(1e-3).scale(1e-4));
      }
    }
    // The fork is gone; the prompt's scores and pages are as they were.
    kvgc_stats stats;
    kvgc_stats_init(&stats);
    REQUIRE(kvgc_get_stats(e.heap(), &stats) == KVGC_OK);
    CHECK(stats.sequences == 1);
    CHECK(stats.live_tokens == uint64_t(n) * c.n_layers);
    CHECK(observed_scores(e, c.n_layers) == before);
    CHECK(kvgc_heap_check(e.heap()) == KVGC_OK);
    // Chunked: each token's peak is over its own chunk's repeat only, so no chunk's exceeds
    // the one-fork signal's support, and some token gets mass.
    engine::EngineOptions small = eo;
    small.reconstruct_chunk = 7;
    engine::Engine e2;
    REQUIRE_MESSAGE(e2.init(tiny.model, &opts, &err, small), err);
    REQUIRE_MESSAGE(e2.prefill(ids.data(), uint32_t(n), logits.data(), &err,
                               engine::Engine::PrefillMode::Observe), err);
    engine::Engine::LayerMass chunked;
    REQUIRE_MESSAGE(e2.reconstruction_mass(e2.sequence(), 0, ids.data(), uint32_t(n), &chunked, &err), err);
    REQUIRE(kvgc_get_stats(e2.heap(), &stats) == KVGC_OK);
    CHECK(stats.sequences == 1);
    double total = 0;
    for (const auto& layer : chunked)
      for (const float m : layer) {
        CHECK(m >= 0.0f);
        CHECK(m <= 1.0f);
        total += m;
      }
    CHECK(total > 0);
  }
}

// Loads a variant of the tiny model; the loader's error (empty if it loaded).
std::string load_error(const Variant& v) {
  TempGguf gguf(TinyModelFile().build(TinyVocab(), v), "variant");
  std::string err;
  if (!gguf.open(&err)) return "gguf: " + err;  // the reader's own checks came first
  engine::Model model;
  if (engine::load_model(gguf.file, &model, &err)) return "";
  CHECK_FALSE(err.empty());
  return err;
}

TEST_CASE("engine: the loader bounds every count and names what is wrong, before allocating") {
  auto with = [](auto change) {
    Variant v;
    change(v);
    return load_error(v);
  };
  CHECK(load_error({}) == "");
  // #13: a block count of 4e9 reached layers.assign and aborted with bad_alloc.
  std::string err = with([](Variant& v) { v.block_count = 4000000000u; });
  CHECK(err.find("llama.block_count is 4000000000") != std::string::npos);
  err = with([](Variant& v) { v.block_count = 3; });  // beyond the tensors the file holds
  CHECK(err.find("needs at least 27 tensors (9 a block); the file holds 20") != std::string::npos);
  err = with([](Variant& v) { v.embd = 1000000000u; });
  CHECK(err.find("llama.embedding_length is 1000000000") != std::string::npos);
  err = with([](Variant& v) { v.heads = 0; });
  CHECK(err.find("llama.attention.head_count is 0") != std::string::npos);
  err = with([](Variant& v) { v.kv_heads = 3; });
  CHECK(err.find("unsupported attention shape: 4 heads, 3 kv heads") != std::string::npos);
  err = with([](Variant& v) { v.rms_eps = NAN; });
  CHECK(err.find("layer_norm_rms_epsilon") != std::string::npos);
  err = with([](Variant& v) { v.drop = "token_embd.weight"; });
  CHECK(err.find("missing tensor token_embd.weight") != std::string::npos);
  err = with([](Variant& v) { v.drop = "blk.1.ffn_up.weight"; });
  CHECK(err.find("missing tensor blk.1.ffn_up.weight") != std::string::npos);
  err = with([](Variant& v) { v.reshape = "blk.0.attn_k.weight"; });
  CHECK(err.find("tensor blk.0.attn_k.weight has shape (64, 16), expected (32, 16)") !=
        std::string::npos);
  err = with([](Variant& v) { v.retype = "blk.0.attn_q.weight", v.new_type = 2; });  // Q4_0
  CHECK(err.find("tensor blk.0.attn_q.weight has type Q4_0, which kvgc-run cannot multiply "
                 "(supported: F32, F16, Q4_1, Q8_0)") != std::string::npos);
  err = with([](Variant& v) { v.retype = "blk.1.ffn_norm.weight", v.new_type = 30; });  // BF16
  CHECK(err.find("tensor blk.1.ffn_norm.weight has type BF16") != std::string::npos);
  // Rows of 48 elements are not whole Q8_0 blocks, though the 1536 elements are (the GGUF
  // reader refuses it first).
  err = with([](Variant& v) { v.retype = "blk.0.ffn_down.weight", v.new_type = engine::kGgmlQ8_0; });
  CHECK(err.find("blk.0.ffn_down.weight") != std::string::npos);
  CHECK(err.find("block of 32") != std::string::npos);
}

TEST_CASE("engine: logits that turn NaN or infinite end the forward pass with an error") {
  Variant huge;
  huge.huge = 1e30f;
  TinyModel tiny(huge);
  const kvgc_heap_options opts = full_policy_options();
  const std::vector<int32_t> ids = tiny.tokenizer.encode("hello world");
  for (const kvgc_dtype kv : {KVGC_DTYPE_F16, KVGC_DTYPE_F32}) {
    engine::EngineOptions eopts;
    eopts.kv_dtype = kv;
    engine::Engine e;
    std::string err;
    REQUIRE_MESSAGE(e.init(tiny.model, &opts, &err, eopts), err);
    std::vector<float> logits(tiny.model.config.n_vocab);
    CHECK_FALSE(e.forward(ids.data(), uint32_t(ids.size()), logits.data(), &err));
    CAPTURE(err);
    CHECK((err.find("not finite") != std::string::npos ||
           err.find("finite") != std::string::npos));
  }
}

#ifdef KVGC_RUN_EXE
// kvgc-run's exit status and stderr on `model` (a crafted file).
int run_kvgc_run(const std::filesystem::path& model, std::string* output) {
  const std::string command = std::string(KVGC_RUN_EXE) + " --model '" + model.string() +
                              "' --prompt 'hello world' --max-tokens 4 --threads 1 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  size_t got = 0;
  while ((got = fread(buffer, 1, sizeof buffer, pipe)) > 0) output->append(buffer, got);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_CASE("engine: kvgc-run ends every failure with a message and exit status 1") {
  Variant crafted;
  crafted.block_count = 4000000000u;  // aborted with bad_alloc (exit 134) before the bounds
  TempGguf bad(TinyModelFile().build(TinyVocab(), crafted), "crafted");
  std::string output;
  CHECK(run_kvgc_run(bad.path, &output) == 1);
  CHECK(output.find("kvgc-run: metadata llama.block_count is 4000000000") != std::string::npos);

  Variant huge;
  huge.huge = 1e30f;  // logits overflow: printed nothing and exited 0 before the check
  TempGguf broken(TinyModelFile().build(TinyVocab(), huge), "huge");
  output.clear();
  CHECK(run_kvgc_run(broken.path, &output) == 1);
  CHECK(output.find("finite") != std::string::npos);

  TempGguf fine(TinyModelFile().build(TinyVocab()), "fine");
  output.clear();
  CHECK(run_kvgc_run(fine.path, &output) == 0);
  CHECK(output.find("decode") != std::string::npos);
}

// `command` run by the shell, its exit status and its stdout and stderr.
int run_shell(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  size_t got = 0;
  while ((got = fread(buffer, 1, sizeof buffer, pipe)) > 0) output->append(buffer, got);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_CASE("engine: kvgc-run and kvgc-serve refuse a --key-prior or --reconstruct that is not a weight >= 0") {
  // kvgc-serve has no --reconstruct (its prefills are batched: ARCHITECTURE.md).
  std::vector<std::pair<std::string, std::string>> uses = {
      {std::string(KVGC_RUN_EXE), "--key-prior"}, {std::string(KVGC_RUN_EXE), "--reconstruct"}};
#ifdef KVGC_SERVE_EXE
  if (std::filesystem::exists(KVGC_SERVE_EXE))
    uses.push_back({std::string(KVGC_SERVE_EXE) + " x", "--key-prior"});
#endif
  for (const auto& [tool, flag] : uses) {
    for (const char* bad : {"-1", "abc", "inf", "nan", "1x", "''"}) {
      CAPTURE(tool);
      CAPTURE(flag);
      CAPTURE(bad);
      std::string output;
      CHECK(run_shell(tool + " " + flag + " " + bad + " --model /nonexistent.gguf", &output) == 2);
      CHECK(output.find(flag + " must be a finite weight >= 0") != std::string::npos);
    }
    // A good weight passes the parser: the tool goes on to the (missing) model.
    std::string output;
    CHECK(run_shell(tool + " " + flag + " 0.5 --model /nonexistent.gguf", &output) != 0);
    CHECK(output.find(flag) == std::string::npos);
  }
}

TEST_CASE("engine: kvgc-run refuses a --reconstruct-signal other than mass or head-peak") {
  for (const char* bad : {"peak", "MASS", "''", "head-peak,mass"}) {
    CAPTURE(bad);
    std::string output;
    CHECK(run_shell(std::string(KVGC_RUN_EXE) + " --reconstruct-signal " + bad +
                        " --model /nonexistent.gguf", &output) == 2);
    CHECK(output.find("--reconstruct-signal must be mass or head-peak") != std::string::npos);
  }
  for (const char* good : {"mass", "head-peak"}) {  // parsed: on to the (missing) model
    CAPTURE(good);
    std::string output;
    CHECK(run_shell(std::string(KVGC_RUN_EXE) + " --reconstruct-signal " + good +
                        " --model /nonexistent.gguf", &output) != 0);
    CHECK(output.find("--reconstruct-signal") == std::string::npos);
  }
}

// Issue 22: `kvgc-serve /dev/zero` grew one line without a bound (3.1 GB of RSS in 10 s
// before it said "holds no prompt"). Prompt files are now read up to 64 MiB, then refused
// with a message naming the bound; kvgc-run's --prompt-file the same. The tools run with
// their address space capped at 1 GiB (not under ASan, which reserves far more), so an
// unbounded read fails at the cap at once instead of taking the machine (before the fix:
// kvgc-run "out of memory", kvgc-serve's getline gave up and said "holds no prompt").
TEST_CASE("engine: kvgc-serve and kvgc-run read a prompt file up to 64 MiB, then refuse it") {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  const std::string cap;
#else
  const std::string cap = "ulimit -v 1048576; ";
#endif
  std::vector<std::string> tools = {std::string(KVGC_RUN_EXE) + " --prompt-file"};
#ifdef KVGC_SERVE_EXE
  if (std::filesystem::exists(KVGC_SERVE_EXE))  // the sanitizer trees build only kvgc-run
    tools.push_back(KVGC_SERVE_EXE);
#endif
  for (const std::string& tool : tools) {
    CAPTURE(tool);
    std::string output;
    CHECK(run_shell(cap + tool + " /dev/zero --model /nonexistent.gguf", &output) == 2);
    CAPTURE(output);
    CHECK(output.find("'/dev/zero' holds more than 64 MiB") != std::string::npos);
    CHECK(output.find("holds no prompt") == std::string::npos);
    // A regular file past the bound is refused unread (a sparse one: no disk used).
    TempGguf big("", "big_prompts");
    std::filesystem::resize_file(big.path, (70u << 20));
    output.clear();
    CHECK(run_shell(cap + tool + " '" + big.path.string() + "' --model /nonexistent.gguf", &output) == 2);
    CHECK(output.find("holds 73400320 bytes, more than the 64 MiB") != std::string::npos);
    // Within the bound, the file is read: an empty one holds no prompt (kvgc-serve), or
    // the tool goes on to the model (kvgc-run).
    TempGguf empty("", "prompts");  // any file: an empty one
    output.clear();
    run_shell(cap + tool + " '" + empty.path.string() + "' --model /nonexistent.gguf", &output);
    CHECK(output.find("64 MiB") == std::string::npos);
  }
}
#endif
