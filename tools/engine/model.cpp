#include "engine/model.hpp"

#include <cmath>
#include <cstdlib>

namespace engine {
namespace {

std::string shape(const std::vector<uint64_t>& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

// Finds tensors and checks each against the shape and types the architecture needs.
class TensorLoader {
 public:
  TensorLoader(const gguf::File& file, std::string* err) : file_(file), err_(err) {}

  bool present(const std::string& name) const { return file_.find_tensor(name) != nullptr; }

  // The tensor `name` with ggml dims `dims` (fastest-varying first), its bytes in the file.
  const gguf::TensorInfo* find(const std::string& name, const std::vector<uint64_t>& dims) {
    const gguf::TensorInfo* info = file_.find_tensor(name);
    if (info == nullptr) return fail_null("missing tensor " + name);
    if (info->dims != dims) {
      return fail_null("tensor " + name + " has shape " + shape(info->dims) + ", expected " +
                       shape(dims));
    }
    const uint64_t bytes = tensor_bytes(info->ggml_type, info->n_elements);
    if (bytes == 0 || !row_fits_blocks(info->ggml_type, dims[0])) {
      return fail_null("tensor " + name + " has type " +
                       gguf::ggml_type_name(info->ggml_type) + ", which kvgc-run cannot " +
                       (bytes == 0 && tensor_bytes(info->ggml_type, 32) == 0
                            ? "multiply (supported: " + std::string(kSupportedTypes) + ")"
                            : "use: its rows of " + std::to_string(dims[0]) +
                                  " elements are not whole blocks of 32"));
    }
    if (info->offset > file_.file_size() ||
        file_.data_offset() + info->offset + bytes > file_.file_size()) {
      return fail_null("tensor " + name + " runs past the end of the file");
    }
    return info;
  }

  // A matrix [rows][cols] (GGUF dims (cols, rows)), left in the file.
  bool matrix(const std::string& name, uint64_t cols, uint64_t rows, Matrix* out) {
    const gguf::TensorInfo* info = find(name, {cols, rows});
    if (info == nullptr) return false;
    out->type = info->ggml_type;
    out->rows = uint32_t(rows);
    out->cols = uint32_t(cols);
    out->row_bytes = tensor_bytes(info->ggml_type, cols);
    out->data = file_.tensor_data(*info);
    return true;
  }

  // A vector, copied out as f32.
  bool vector(const std::string& name, uint64_t n, std::vector<float>* out) {
    const gguf::TensorInfo* info = find(name, {n});
    if (info == nullptr) return false;
    out->resize(n);
    return dequantize(info->ggml_type, file_.tensor_data(*info), n, out->data(), err_);
  }

  bool fail(const std::string& message) {
    if (err_) *err_ = message;
    return false;
  }

 private:
  const gguf::TensorInfo* fail_null(const std::string& message) {
    fail(message);
    return nullptr;
  }

  const gguf::File& file_;
  std::string* err_;
};

}  // namespace

std::string default_model_path() {
  if (const char* env = std::getenv("KVGC_MODEL"); env && *env) return env;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/kvgc/" + kDefaultModelFile;
}

uint64_t Model::weight_bytes() const {
  auto bytes = [](const Matrix& m) { return m.data ? uint64_t(m.rows) * m.row_bytes : 0; };
  uint64_t total = bytes(token_embd) + bytes(output);
  for (const LayerWeights& w : layers) {
    total += bytes(w.wq) + bytes(w.wk) + bytes(w.wv) + bytes(w.wo) + bytes(w.w_gate) +
             bytes(w.w_up) + bytes(w.w_down);
  }
  return total;
}

bool load_model(const gguf::File& file, Model* model, std::string* err) {
  TensorLoader loader(file, err);
  const std::string arch = file.get_string("general.architecture").value_or("");
  if (arch != "llama") {
    return loader.fail("general.architecture is '" + arch + "'; kvgc-run runs llama models");
  }
  // Every count within [lo, hi] before anything is sized by it.
  auto count = [&](const std::string& key, std::optional<uint64_t> fallback, uint64_t lo,
                   uint64_t hi, uint64_t* out) {
    const std::optional<uint64_t> value = file.get_uint(arch + "." + key);
    if (!value && !fallback) return loader.fail("missing or invalid metadata " + arch + "." + key);
    *out = value ? *value : *fallback;
    if (*out < lo || *out > hi) {
      return loader.fail("metadata " + arch + "." + key + " is " + std::to_string(*out) +
                         ", outside the " + std::to_string(lo) + ".." + std::to_string(hi) +
                         " kvgc-run accepts");
    }
    return true;
  };
  using L = ModelLimits;
  Config& c = model->config;
  uint64_t layers = 0, embd = 0, ff = 0, heads = 0, kv_heads = 0, head_dim = 0, ctx = 0;
  if (!count("block_count", std::nullopt, 1, L::kMaxLayers, &layers) ||
      !count("embedding_length", std::nullopt, 1, L::kMaxEmbd, &embd) ||
      !count("feed_forward_length", std::nullopt, 1, L::kMaxFf, &ff) ||
      !count("attention.head_count", std::nullopt, 1, L::kMaxHeads, &heads) ||
      !count("attention.head_count_kv", heads, 1, heads, &kv_heads)) {
    return false;
  }
  const std::optional<uint64_t> rope_dims = file.get_uint(arch + ".rope.dimension_count");
  if (!count("attention.key_length", rope_dims ? *rope_dims : embd / heads, 2, L::kMaxHeadDim,
             &head_dim) ||
      !count("context_length", 2048, 1, L::kMaxContext, &ctx)) {
    return false;
  }
  if (heads % kv_heads != 0 || head_dim % 2 != 0) {
    return loader.fail("unsupported attention shape: " + std::to_string(heads) + " heads, " +
                       std::to_string(kv_heads) + " kv heads, head_dim " +
                       std::to_string(head_dim) + " (heads must be a multiple of kv heads, " +
                       "head_dim even)");
  }
  // A llama of `layers` blocks has 9 tensors a block: a block count beyond what the file
  // holds is refused before layers are allocated.
  const uint64_t tensors_needed = layers * L::kTensorsPerLayer;
  if (file.tensors().size() < tensors_needed) {
    return loader.fail("metadata " + arch + ".block_count is " + std::to_string(layers) +
                       ", which needs at least " + std::to_string(tensors_needed) +
                       " tensors (9 a block); the file holds " +
                       std::to_string(file.tensors().size()));
  }
  const double rope_base = file.get_float(arch + ".rope.freq_base").value_or(10000.0);
  const double rms_eps =
      file.get_float(arch + ".attention.layer_norm_rms_epsilon").value_or(1e-5);
  if (!std::isfinite(rope_base) || rope_base <= 1.0 || rope_base > 1e12) {
    return loader.fail("metadata " + arch + ".rope.freq_base is " + std::to_string(rope_base) +
                       ", not a RoPE base (1, 1e12]");
  }
  if (!std::isfinite(rms_eps) || rms_eps <= 0.0 || rms_eps >= 1.0) {
    return loader.fail("metadata " + arch + ".attention.layer_norm_rms_epsilon is " +
                       std::to_string(rms_eps) + ", not in (0, 1)");
  }
  c.n_layers = uint32_t(layers);
  c.n_embd = uint32_t(embd);
  c.n_ff = uint32_t(ff);
  c.n_heads = uint32_t(heads);
  c.n_kv_heads = uint32_t(kv_heads);
  c.head_dim = uint32_t(head_dim);
  c.n_ctx = ctx;
  c.rope_base = float(rope_base);
  c.rms_eps = float(rms_eps);

  const gguf::TensorInfo* embd_info = file.find_tensor("token_embd.weight");
  if (embd_info == nullptr) return loader.fail("missing tensor token_embd.weight");
  if (embd_info->dims.size() != 2 || embd_info->dims[1] == 0 ||
      embd_info->dims[1] > L::kMaxVocab) {
    return loader.fail("tensor token_embd.weight has shape " + shape(embd_info->dims) +
                       ", expected (" + std::to_string(embd) + ", vocabulary of 1.." +
                       std::to_string(L::kMaxVocab) + ")");
  }
  c.n_vocab = uint32_t(embd_info->dims[1]);

  const uint64_t q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
  if (!loader.matrix("token_embd.weight", embd, c.n_vocab, &model->token_embd) ||
      !loader.vector("output_norm.weight", embd, &model->output_norm)) {
    return false;
  }
  model->output = Matrix{};
  if (loader.present("output.weight") &&
      !loader.matrix("output.weight", embd, c.n_vocab, &model->output)) {
    return false;
  }
  model->layers.assign(c.n_layers, {});
  for (uint32_t i = 0; i < c.n_layers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    LayerWeights& w = model->layers[i];
    if (!loader.vector(p + "attn_norm.weight", embd, &w.attn_norm) ||
        !loader.matrix(p + "attn_q.weight", embd, q_dim, &w.wq) ||
        !loader.matrix(p + "attn_k.weight", embd, kv_dim, &w.wk) ||
        !loader.matrix(p + "attn_v.weight", embd, kv_dim, &w.wv) ||
        !loader.matrix(p + "attn_output.weight", q_dim, embd, &w.wo) ||
        !loader.vector(p + "ffn_norm.weight", embd, &w.ffn_norm) ||
        !loader.matrix(p + "ffn_gate.weight", embd, ff, &w.w_gate) ||
        !loader.matrix(p + "ffn_up.weight", embd, ff, &w.w_up) ||
        !loader.matrix(p + "ffn_down.weight", ff, embd, &w.w_down)) {
      return false;
    }
  }
  return true;
}

}  // namespace engine
