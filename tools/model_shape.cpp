#include "model_shape.hpp"

#include <filesystem>
#include <limits>
#include <optional>

namespace kvgc_tools {
namespace {

bool fail(std::string* err, std::string msg) {
  if (err) *err = std::move(msg);
  return false;
}

// ---- config.json -----------------------------------------------------------------

// The members a shape is read from, at the root and under "text_config".
constexpr const char* kConfigKeys[] = {
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_size",       "max_position_embeddings", "torch_dtype",    "dtype",
    "model_type",        "_name_or_path"};

// One object level of the config: the root, or "text_config".
struct Level {
  const json::Document& doc;
  const char* parent;  // null for the root
  const json::Value* find(const std::string& key) const {
    return doc.find(parent ? json::Path{parent, key} : json::Path{key});
  }
};

// Integer member `key`: nullopt in *out if absent or null (HF writes null for "unset").
bool config_int(const Level& cfg, const std::string& key, std::optional<int64_t>* out,
                std::string* err) {
  out->reset();
  const json::Value* v = cfg.find(key);
  if (!v || v->is_null()) return true;
  *out = v->as_int();
  if (!*out) return fail(err, "\"" + key + "\" must be an integer");
  return true;
}

bool config_count(const Level& cfg, const std::string& key, std::optional<uint32_t>* out,
                  std::string* err) {
  std::optional<int64_t> v;
  out->reset();
  if (!config_int(cfg, key, &v, err)) return false;
  if (!v) return true;
  if (*v <= 0 || uint64_t(*v) > std::numeric_limits<uint32_t>::max())
    return fail(err, "\"" + key + "\" is " + std::to_string(*v) + "; expected a positive count");
  *out = uint32_t(*v);
  return true;
}

kvgc_dtype dtype_from_torch(const std::string& s) {
  if (s == "bfloat16") return KVGC_DTYPE_BF16;
  if (s == "float32") return KVGC_DTYPE_F32;
  return KVGC_DTYPE_F16;
}

// ---- GGUF ------------------------------------------------------------------------

bool gguf_count(const gguf::File& f, const std::string& key, bool required,
                std::optional<uint32_t>* out, std::string* err) {
  out->reset();
  const gguf::Value* v = f.find(key);
  if (!v) return required ? fail(err, "missing metadata key " + key) : true;
  if (v->type == gguf::ValueType::kArray)
    return fail(err, key + " is an array (per-layer values); kvgc models one value for all "
                           "layers");
  const std::optional<uint64_t> u = f.get_uint(key);
  if (!u) return fail(err, key + " is " + gguf::type_name(v->type) + "; expected an integer");
  if (*u == 0 || *u > std::numeric_limits<uint32_t>::max())
    return fail(err, key + " is " + std::to_string(*u) + "; expected a positive count");
  *out = uint32_t(*u);
  return true;
}

}  // namespace

const char* dtype_name(kvgc_dtype dtype) {
  switch (dtype) {
    case KVGC_DTYPE_F16: return "f16";
    case KVGC_DTYPE_BF16: return "bf16";
    case KVGC_DTYPE_F32: return "f32";
  }
  return "?";
}

std::string name_from_path(const std::string& path) {
  const std::filesystem::path p(path);
  if (p.filename() == "config.json") {
    const std::string parent = std::filesystem::absolute(p).parent_path().filename().string();
    if (!parent.empty()) return parent;
  }
  return p.stem().string();
}

bool validate_shape(const ModelShape& shape, std::string* err) {
  uint64_t bytes = 0;
  if (kvgc_kv_bytes(&shape.desc, 1, KVGC_CLASS_FP16, 0, &bytes) == KVGC_OK) return true;
  return fail(err, "kvgc cannot hold this model's KV cache: " +
                       std::string(kvgc_errmsg(nullptr)));
}

const std::vector<json::Path>& config_paths() {
  static const std::vector<json::Path> paths = [] {
    std::vector<json::Path> p{{"text_config"}};
    for (const char* k : kConfigKeys) {
      p.push_back({k});
      p.push_back({"text_config", k});
    }
    return p;
  }();
  return paths;
}

bool shape_from_config(const json::Document& doc, const std::string& fallback_name,
                       ModelShape* out, std::string* err) {
  if (doc.root != json::Value::Kind::kObject) return fail(err, "config.json must be a JSON object");
  const Level root{doc, nullptr};
  // Multimodal configs (Llava, Gemma 3, ...) keep the language model under text_config.
  const json::Value* text = root.find("text_config");
  const Level cfg{doc, !root.find("num_hidden_layers") && text && text->is_object()
                           ? "text_config"
                           : nullptr};

  std::optional<uint32_t> layers, heads, kv_heads, head_dim, hidden;
  std::optional<int64_t> context;
  if (!config_count(cfg, "num_hidden_layers", &layers, err) ||
      !config_count(cfg, "num_attention_heads", &heads, err) ||
      !config_count(cfg, "num_key_value_heads", &kv_heads, err) ||
      !config_count(cfg, "head_dim", &head_dim, err) ||
      !config_count(cfg, "hidden_size", &hidden, err) ||
      !config_int(cfg, "max_position_embeddings", &context, err))
    return false;
  if (context && *context <= 0)
    return fail(err, "\"max_position_embeddings\" is " + std::to_string(*context) +
                         "; expected a positive count (or null, or no such key)");
  if (!layers) return fail(err, "missing \"num_hidden_layers\"");
  if (!heads) return fail(err, "missing \"num_attention_heads\"");
  if (!head_dim) {
    if (!hidden) return fail(err, "missing \"head_dim\" and \"hidden_size\" (one is needed)");
    if (*hidden % *heads)
      return fail(err, "\"hidden_size\" " + std::to_string(*hidden) +
                           " is not a multiple of \"num_attention_heads\" " +
                           std::to_string(*heads) + "; give \"head_dim\"");
    head_dim = *hidden / *heads;
  }

  ModelShape s;
  kvgc_model_desc_init(&s.desc);
  s.desc.n_layers = *layers;
  s.desc.n_q_heads = *heads;
  s.desc.n_kv_heads = kv_heads.value_or(*heads);
  s.desc.head_dim = *head_dim;
  s.desc.dtype = KVGC_DTYPE_F16;
  for (const char* key : {"torch_dtype", "dtype"}) {
    const json::Value* v = cfg.find(key);
    if (!v || v->is_null()) v = root.find(key);
    if (v && v->as_string()) {
      s.desc.dtype = dtype_from_torch(*v->as_string());
      break;
    }
  }
  s.hidden_size = hidden.value_or(0);
  s.context_length = context ? uint64_t(*context) : 0;
  const json::Value* model_type = cfg.find("model_type");
  if (model_type && model_type->as_string()) s.architecture = *model_type->as_string();
  const json::Value* name = root.find("_name_or_path");
  s.name = name && name->as_string() && !name->as_string()->empty() ? *name->as_string()
                                                                      : fallback_name;
  if (!validate_shape(s, err)) return false;
  *out = std::move(s);
  return true;
}

bool shape_from_config_text(std::string_view text, const std::string& fallback_name,
                            ModelShape* out, std::string* err) {
  json::Document doc;
  if (!json::parse(text, config_paths(), &doc, err)) return false;
  return shape_from_config(doc, fallback_name, out, err);
}

bool load_config_shape(const std::string& path, ModelShape* out, std::string* err) {
  json::Document doc;
  std::string msg;
  if (!json::parse_file(path, config_paths(), &doc, err)) return false;
  if (!shape_from_config(doc, name_from_path(path), out, &msg))
    return fail(err, path + ": " + msg);
  out->source = path;
  return true;
}

bool shape_from_gguf(const gguf::File& f, const std::string& fallback_name, ModelShape* out,
                     std::string* err) {
  const std::optional<std::string> arch = f.get_string("general.architecture");
  if (!arch || arch->empty()) return fail(err, "missing metadata key general.architecture");
  const std::string p = *arch + ".";

  std::optional<uint32_t> layers, heads, kv_heads, embedding, key_length, value_length;
  if (!gguf_count(f, p + "block_count", true, &layers, err) ||
      !gguf_count(f, p + "attention.head_count", true, &heads, err) ||
      !gguf_count(f, p + "attention.head_count_kv", false, &kv_heads, err) ||
      !gguf_count(f, p + "embedding_length", false, &embedding, err) ||
      !gguf_count(f, p + "attention.key_length", false, &key_length, err) ||
      !gguf_count(f, p + "attention.value_length", false, &value_length, err))
    return false;
  if (!key_length) {
    if (!embedding)
      return fail(err, "missing " + p + "attention.key_length and " + p +
                           "embedding_length (one is needed)");
    if (*embedding % *heads)
      return fail(err, p + "embedding_length " + std::to_string(*embedding) +
                           " is not a multiple of " + p + "attention.head_count " +
                           std::to_string(*heads));
    key_length = *embedding / *heads;
  }
  if (value_length && *value_length != *key_length)
    return fail(err, "K and V head sizes differ (" + std::to_string(*key_length) + " and " +
                         std::to_string(*value_length) + "); kvgc models one head_dim");

  ModelShape s;
  kvgc_model_desc_init(&s.desc);
  s.desc.n_layers = *layers;
  s.desc.n_q_heads = *heads;
  s.desc.n_kv_heads = kv_heads.value_or(*heads);
  s.desc.head_dim = *key_length;
  s.desc.dtype = KVGC_DTYPE_F16;
  s.architecture = *arch;
  s.hidden_size = embedding.value_or(0);
  s.context_length = f.get_uint(p + "context_length").value_or(0);
  const std::optional<std::string> name = f.get_string("general.name");
  s.name = name && !name->empty() ? *name : fallback_name;
  if (!validate_shape(s, err)) return false;
  *out = std::move(s);
  return true;
}

bool load_gguf_shape(const std::string& path, ModelShape* out, std::string* err) {
  gguf::File file;
  std::string msg;
  if (!file.open(path, err)) return false;
  if (!shape_from_gguf(file, name_from_path(path), out, &msg)) return fail(err, path + ": " + msg);
  out->source = path;
  return true;
}

bool shape_from_dims(uint32_t layers, uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim,
                     kvgc_dtype dtype, ModelShape* out, std::string* err) {
  ModelShape s;
  kvgc_model_desc_init(&s.desc);
  s.desc.n_layers = layers;
  s.desc.n_q_heads = q_heads;
  s.desc.n_kv_heads = kv_heads;
  s.desc.head_dim = head_dim;
  s.desc.dtype = dtype;
  s.name = "custom";
  s.source = "command line";
  if (!validate_shape(s, err)) return false;
  *out = std::move(s);
  return true;
}

}  // namespace kvgc_tools
