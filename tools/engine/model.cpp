#include "engine/model.hpp"

#include <cstdlib>

#include <cmath>
#include <cstring>

namespace engine {

float f16_to_f32(uint16_t half) {
  const uint32_t sign = uint32_t(half >> 15) << 31;
  const uint32_t exponent = (half >> 10) & 0x1f;
  const uint32_t mantissa = half & 0x3ff;
  float value;
  if (exponent == 0) {
    value = std::ldexp(float(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = std::ldexp(float(mantissa | 0x400), int(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits |= sign;
  std::memcpy(&value, &bits, sizeof bits);
  return value;
}

namespace {

uint16_t read_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

constexpr uint64_t kQ4_1BlockBytes = 4 + kQuantBlock / 2;  // f16 d, f16 m, nibbles
constexpr uint64_t kQ8_0BlockBytes = 2 + kQuantBlock;      // f16 d, int8 values

void dequantize_q4_1(const uint8_t* data, uint64_t n_blocks, float* out) {
  for (uint64_t b = 0; b < n_blocks; ++b, data += kQ4_1BlockBytes, out += kQuantBlock) {
    const float scale = f16_to_f32(read_u16(data));
    const float minimum = f16_to_f32(read_u16(data + 2));
    const uint8_t* nibbles = data + 4;
    for (uint32_t j = 0; j < kQuantBlock / 2; ++j) {
      out[j] = scale * float(nibbles[j] & 0x0f) + minimum;
      out[j + kQuantBlock / 2] = scale * float(nibbles[j] >> 4) + minimum;
    }
  }
}

void dequantize_q8_0(const uint8_t* data, uint64_t n_blocks, float* out) {
  for (uint64_t b = 0; b < n_blocks; ++b, data += kQ8_0BlockBytes, out += kQuantBlock) {
    const float scale = f16_to_f32(read_u16(data));
    for (uint32_t j = 0; j < kQuantBlock; ++j) out[j] = scale * float(int8_t(data[2 + j]));
  }
}

// Loads one tensor, checking its shape (ggml order: fastest-varying first).
class TensorLoader {
 public:
  TensorLoader(const gguf::File& file, std::string* err) : file_(file), err_(err) {}

  bool present(const std::string& name) const { return file_.find_tensor(name) != nullptr; }

  bool load(const std::string& name, std::vector<uint64_t> dims, std::vector<float>* out) {
    const gguf::TensorInfo* info = file_.find_tensor(name);
    if (info == nullptr) return fail("missing tensor " + name);
    if (info->dims != dims) return fail("tensor " + name + " has shape " +
                                        shape(info->dims) + ", expected " + shape(dims));
    const uint64_t bytes = tensor_bytes(info->ggml_type, info->n_elements);
    if (bytes == 0) {
      return fail("tensor " + name + " has type " + gguf::ggml_type_name(info->ggml_type) +
                  ", which kvgc-run cannot dequantise (supported: F32, F16, Q4_1, Q8_0)");
    }
    if (file_.data_offset() + info->offset + bytes > file_.file_size()) {
      return fail("tensor " + name + " runs past the end of the file");
    }
    out->resize(info->n_elements);
    return dequantize(info->ggml_type, file_.tensor_data(*info), info->n_elements,
                      out->data(), err_);
  }

  bool fail(const std::string& message) {
    if (err_) *err_ = message;
    return false;
  }

 private:
  static std::string shape(const std::vector<uint64_t>& dims) {
    std::string s = "(";
    for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
    return s + ")";
  }

  const gguf::File& file_;
  std::string* err_;
};

}  // namespace

uint64_t tensor_bytes(uint32_t ggml_type, uint64_t n_elements) {
  switch (ggml_type) {
    case kGgmlF32: return n_elements * 4;
    case kGgmlF16: return n_elements * 2;
    case kGgmlQ4_1:
      return n_elements % kQuantBlock ? 0 : n_elements / kQuantBlock * kQ4_1BlockBytes;
    case kGgmlQ8_0:
      return n_elements % kQuantBlock ? 0 : n_elements / kQuantBlock * kQ8_0BlockBytes;
    default: return 0;
  }
}

bool dequantize(uint32_t ggml_type, const uint8_t* data, uint64_t n_elements, float* out,
                std::string* err) {
  if (tensor_bytes(ggml_type, n_elements) == 0 && n_elements != 0) {
    if (err) *err = "cannot dequantise " + std::to_string(n_elements) + " elements of type " +
                    gguf::ggml_type_name(ggml_type);
    return false;
  }
  switch (ggml_type) {
    case kGgmlF32: std::memcpy(out, data, n_elements * 4); break;
    case kGgmlF16:
      for (uint64_t i = 0; i < n_elements; ++i) out[i] = f16_to_f32(read_u16(data + 2 * i));
      break;
    case kGgmlQ4_1: dequantize_q4_1(data, n_elements / kQuantBlock, out); break;
    case kGgmlQ8_0: dequantize_q8_0(data, n_elements / kQuantBlock, out); break;
    default: break;
  }
  return true;
}

std::string default_model_path() {
  if (const char* env = std::getenv("KVGC_MODEL"); env && *env) return env;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/kvgc/" + kDefaultModelFile;
}

bool load_model(const gguf::File& file, Model* model, std::string* err) {
  TensorLoader loader(file, err);
  const std::string arch = file.get_string("general.architecture").value_or("");
  if (arch != "llama") {
    return loader.fail("general.architecture is '" + arch + "'; kvgc-run runs llama models");
  }
  Config& c = model->config;
  auto require = [&](const char* key, uint32_t* out) {
    const auto value = file.get_uint(arch + "." + key);
    if (!value || *value == 0 || *value > UINT32_MAX) {
      return loader.fail("missing or invalid metadata " + arch + "." + key);
    }
    *out = uint32_t(*value);
    return true;
  };
  if (!require("block_count", &c.n_layers) || !require("embedding_length", &c.n_embd) ||
      !require("feed_forward_length", &c.n_ff) || !require("attention.head_count", &c.n_heads)) {
    return false;
  }
  c.n_kv_heads = uint32_t(file.get_uint(arch + ".attention.head_count_kv").value_or(c.n_heads));
  c.head_dim = uint32_t(file.get_uint(arch + ".attention.key_length")
                            .value_or(file.get_uint(arch + ".rope.dimension_count")
                                          .value_or(c.n_embd / c.n_heads)));
  if (c.n_kv_heads == 0 || c.n_heads % c.n_kv_heads != 0 || c.head_dim % 2 != 0) {
    return loader.fail("unsupported attention shape: " + std::to_string(c.n_heads) +
                       " heads, " + std::to_string(c.n_kv_heads) + " kv heads, head_dim " +
                       std::to_string(c.head_dim));
  }
  c.n_ctx = file.get_uint(arch + ".context_length").value_or(2048);
  c.rope_base = float(file.get_float(arch + ".rope.freq_base").value_or(10000.0));
  c.rms_eps = float(file.get_float(arch + ".attention.layer_norm_rms_epsilon").value_or(1e-5));

  const gguf::TensorInfo* embd = file.find_tensor("token_embd.weight");
  if (embd == nullptr) return loader.fail("missing tensor token_embd.weight");
  if (embd->dims.size() != 2) return loader.fail("token_embd.weight is not a matrix");
  c.n_vocab = uint32_t(embd->dims[1]);

  const uint64_t embd_dim = c.n_embd, q_dim = uint64_t(c.n_heads) * c.head_dim;
  const uint64_t kv_dim = uint64_t(c.n_kv_heads) * c.head_dim;
  if (!loader.load("token_embd.weight", {embd_dim, c.n_vocab}, &model->token_embd) ||
      !loader.load("output_norm.weight", {embd_dim}, &model->output_norm)) {
    return false;
  }
  model->output.clear();
  if (loader.present("output.weight") &&
      !loader.load("output.weight", {embd_dim, c.n_vocab}, &model->output)) {
    return false;
  }
  model->layers.assign(c.n_layers, {});
  for (uint32_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    LayerWeights& w = model->layers[i];
    if (!loader.load(p + "attn_norm.weight", {embd_dim}, &w.attn_norm) ||
        !loader.load(p + "attn_q.weight", {embd_dim, q_dim}, &w.wq) ||
        !loader.load(p + "attn_k.weight", {embd_dim, kv_dim}, &w.wk) ||
        !loader.load(p + "attn_v.weight", {embd_dim, kv_dim}, &w.wv) ||
        !loader.load(p + "attn_output.weight", {q_dim, embd_dim}, &w.wo) ||
        !loader.load(p + "ffn_norm.weight", {embd_dim}, &w.ffn_norm) ||
        !loader.load(p + "ffn_gate.weight", {embd_dim, c.n_ff}, &w.w_gate) ||
        !loader.load(p + "ffn_up.weight", {embd_dim, c.n_ff}, &w.w_up) ||
        !loader.load(p + "ffn_down.weight", {uint64_t(c.n_ff), embd_dim}, &w.w_down)) {
      return false;
    }
  }
  return true;
}

}  // namespace engine
