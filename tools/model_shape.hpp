// The KV-cache shape of a model, read from a GGUF file's metadata, a Hugging Face
// config.json, or given by hand, and checked against kvgc's own limits.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gguf.hpp"
#include "json.hpp"
#include "kvgc.h"

namespace kvgc_tools {

struct ModelShape {
  std::string name;
  std::string architecture;     // GGUF general.architecture or config model_type; may be ""
  std::string source;           // the file it came from, or "command line"
  kvgc_model_desc desc{};       // struct_size set; valid for kvgc_kv_bytes
  uint32_t hidden_size = 0;     // 0 when unknown
  uint64_t context_length = 0;  // the model's trained context; 0 when unknown
};

// "f16", "bf16", "f32".
const char* dtype_name(kvgc_dtype dtype);

// A display name for a model file: its stem, or the parent directory's name for a
// file called config.json ("models/Llama-3.1-8B/config.json" -> "Llama-3.1-8B").
std::string name_from_path(const std::string& path);

// From config.json: num_hidden_layers, num_attention_heads, num_key_value_heads
// (default: heads), head_dim (default: hidden_size / heads), max_position_embeddings
// (positive, or absent/null), torch_dtype (or dtype); "bfloat16" -> BF16, "float32" ->
// F32, else F16. Multimodal configs whose text model sits under "text_config" are read
// from there. The name is _name_or_path, else `fallback_name`. The document is read for
// the members at config_paths() only (json.hpp: no tree is built).
const std::vector<json::Path>& config_paths();
bool shape_from_config(const json::Document& config, const std::string& fallback_name,
                       ModelShape* out, std::string* err);
bool shape_from_config_text(std::string_view text, const std::string& fallback_name,
                            ModelShape* out, std::string* err);
bool load_config_shape(const std::string& path, ModelShape* out, std::string* err);

// From GGUF metadata, keys prefixed by general.architecture: block_count,
// attention.head_count, attention.head_count_kv (default: head_count),
// attention.key_length (default: embedding_length / head_count), context_length.
// The KV dtype is f16, what GGUF runtimes cache by default. The name is general.name,
// else `fallback_name`.
bool shape_from_gguf(const gguf::File& file, const std::string& fallback_name,
                     ModelShape* out, std::string* err);
bool load_gguf_shape(const std::string& path, ModelShape* out, std::string* err);

// A shape given by its numbers (the command-line form), named "custom".
bool shape_from_dims(uint32_t layers, uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim,
                     kvgc_dtype dtype, ModelShape* out, std::string* err);

// Whether kvgc accepts out->desc; the message is kvgc's own (kvgc_kv_bytes validates).
bool validate_shape(const ModelShape& shape, std::string* err);

}  // namespace kvgc_tools
