// A llama-architecture model read from GGUF: its shape (from the metadata) and its
// weights, dequantised to f32 once at load so the forward pass is plain BLAS.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gguf.hpp"

namespace engine {

// ggml tensor types the loader can dequantise.
constexpr uint32_t kGgmlF32 = 0;
constexpr uint32_t kGgmlF16 = 1;
constexpr uint32_t kGgmlQ4_1 = 3;
constexpr uint32_t kGgmlQ8_0 = 8;
constexpr uint32_t kQuantBlock = 32;  // elements per Q4_1 / Q8_0 block

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

// Matrices are row-major [out][in], the GGUF layout (dims (in, out)): out = W x.
struct LayerWeights {
  std::vector<float> attn_norm;  // [n_embd]
  std::vector<float> wq;         // [n_heads * head_dim][n_embd]
  std::vector<float> wk;         // [n_kv_heads * head_dim][n_embd]
  std::vector<float> wv;         // [n_kv_heads * head_dim][n_embd]
  std::vector<float> wo;         // [n_embd][n_heads * head_dim]
  std::vector<float> ffn_norm;   // [n_embd]
  std::vector<float> w_gate;     // [n_ff][n_embd]
  std::vector<float> w_up;       // [n_ff][n_embd]
  std::vector<float> w_down;     // [n_embd][n_ff]
};

struct Model {
  Config config;
  std::vector<float> token_embd;   // [n_vocab][n_embd]
  std::vector<float> output_norm;  // [n_embd]
  std::vector<float> output;       // [n_vocab][n_embd]; empty when tied to token_embd
  std::vector<LayerWeights> layers;

  const float* output_weights() const {
    return output.empty() ? token_embd.data() : output.data();
  }
};

// IEEE half to float, subnormals and infinities included.
float f16_to_f32(uint16_t half);

// Bytes of `n_elements` elements of `ggml_type`, or 0 for a type this loader cannot read
// (or a block type whose count is not a whole number of blocks).
uint64_t tensor_bytes(uint32_t ggml_type, uint64_t n_elements);

// Dequantises `n_elements` elements of `ggml_type` at `data` into `out`. False (with *err)
// for a type this loader does not support.
bool dequantize(uint32_t ggml_type, const uint8_t* data, uint64_t n_elements, float* out,
                std::string* err);

// Reads the llama config and every weight from an open GGUF file. False with *err naming
// the missing key or tensor, the unexpected shape, or the unsupported type.
bool load_model(const gguf::File& file, Model* model, std::string* err);

// The model the tools use by default (what tools/fetch-model.sh installs), and where:
// $KVGC_MODEL if set, else ~/.cache/kvgc/<kDefaultModelFile>.
inline constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";
std::string default_model_path();

}  // namespace engine
