// A llama-architecture model read from GGUF: its shape (from the metadata) and its
// weights, which stay in their file types inside the file's mapping (matmul.hpp
// multiplies them in place); only the norm vectors are copied out as f32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/matmul.hpp"
#include "engine/quant.hpp"
#include "gguf.hpp"
#include "kvgc.h"

namespace engine {

struct Config {
  uint32_t n_layers = 0;
  uint32_t n_embd = 0;
  uint32_t n_ff = 0;
  uint32_t n_heads = 0;
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t n_vocab = 0;
  uint64_t n_ctx = 0;
  float rope_base = 10000.0f;
  float rms_eps = 1e-5f;
};

// Limits the loader holds every file to before it allocates anything: far above any
// llama model of this engine's class (SmolLM2-135M: 30 layers, 576 wide, 9 heads of 64,
// 49,152 tokens), far below what would exhaust memory or overflow a 32-bit index.
struct ModelLimits {
  static constexpr uint32_t kMaxLayers = 1024;
  static constexpr uint32_t kMaxEmbd = 65536;
  static constexpr uint32_t kMaxFf = 1u << 20;
  static constexpr uint32_t kMaxHeads = 1024;
  static constexpr uint32_t kMaxHeadDim = 1024;
  static constexpr uint32_t kMaxVocab = 1u << 24;
  static constexpr uint64_t kMaxContext = uint64_t(1) << 24;
  static constexpr uint32_t kTensorsPerLayer = 9;
};

// Matrices are [out][in] (GGUF dims (in, out)): out = W x.
struct LayerWeights {
  std::vector<float> attn_norm;  // [n_embd]
  Matrix wq;                     // [n_heads * head_dim][n_embd]
  Matrix wk;                     // [n_kv_heads * head_dim][n_embd]
  Matrix wv;                     // [n_kv_heads * head_dim][n_embd]
  Matrix wo;                     // [n_embd][n_heads * head_dim]
  std::vector<float> ffn_norm;   // [n_embd]
  Matrix w_gate;                 // [n_ff][n_embd]
  Matrix w_up;                   // [n_ff][n_embd]
  Matrix w_down;                 // [n_embd][n_ff]
};

// Points into the gguf::File it was loaded from, which must stay open while it is used.
struct Model {
  Config config;
  Matrix token_embd;               // [n_vocab][n_embd]
  std::vector<float> output_norm;  // [n_embd]
  Matrix output;                   // [n_vocab][n_embd]; data == nullptr when tied
  std::vector<LayerWeights> layers;

  const Matrix& output_weights() const { return output.data ? output : token_embd; }
  // Bytes of weights a decode step streams (every matrix once).
  uint64_t weight_bytes() const;
};

// Reads the llama config and every weight from an open GGUF file. False with *err
// naming the key or tensor: a missing one, a count outside ModelLimits or beyond what
// the file holds, an unexpected shape, or a type the engine cannot multiply. Nothing is
// allocated before the counts are checked.
bool load_model(const gguf::File& file, Model* model, std::string* err);

// The model the tools use by default (what tools/fetch-model.sh installs), and where:
// $KVGC_MODEL if set, else ~/.cache/kvgc/<kDefaultModelFile>.
inline constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";
std::string default_model_path();

// The KV cache shape kvgc is told for this model, K/V stored in `dtype`.
inline kvgc_model_desc kv_desc(const Config& c, kvgc_dtype dtype) {
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = c.n_layers;
  m.n_q_heads = c.n_heads;
  m.n_kv_heads = c.n_kv_heads;
  m.head_dim = c.head_dim;
  m.dtype = dtype;
  return m;
}

}  // namespace engine
