#include "gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <new>
#include <type_traits>
#include <unordered_set>
#include <utility>

namespace gguf {
namespace {

constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;         // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;        // real files nest at most once
// Real models have ~50 metadata pairs and at most a few thousand tensors; the caps bound
// what a hostile header can make us allocate (each pair or tensor costs ~200 bytes of
// bookkeeping, whatever its size in the file) to a few MiB.
constexpr uint64_t kMaxKeyValues = uint64_t(1) << 16;
constexpr uint64_t kMaxTensors = uint64_t(1) << 16;
// The GGUF spec caps keys at 2^16 - 1 bytes; ggml caps tensor names at 63. Names are
// checked before they are copied, so a length field equal to the file size costs
// nothing (it used to be copied, then copied again into each error message).
constexpr uint64_t kMaxKeyBytes = 65535;
constexpr uint64_t kMaxTensorNameBytes = 1024;
// Error messages quote at most this much of a key or name.
constexpr size_t kQuoteBytes = 64;
constexpr uint64_t kMinKeyValueBytes = 8 + 4 + 1;      // empty key, type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // empty name, 0 dims, type, offset
constexpr uint64_t kArrayHeaderBytes = 4 + 8;

// Bytes of one element of a fixed-size type; 0 for STRING and ARRAY; nullopt if invalid.
std::optional<uint64_t> fixed_size(ValueType t) {
  switch (t) {
    case ValueType::kUInt8: case ValueType::kInt8: case ValueType::kBool: return 1;
    case ValueType::kUInt16: case ValueType::kInt16: return 2;
    case ValueType::kUInt32: case ValueType::kInt32: case ValueType::kFloat32: return 4;
    case ValueType::kUInt64: case ValueType::kInt64: case ValueType::kFloat64: return 8;
    case ValueType::kString: case ValueType::kArray: return 0;
  }
  return std::nullopt;
}

struct GgmlType {
  const char* name;
  uint32_t block;  // elements per block
  uint32_t bytes;  // bytes per block
};

// ggml_type ids as stored in GGUF, with block sizes as in gguf-py's GGML_QUANT_SIZES.
// Removed ids (4, 5, 31-33, 36-38) have no entry, nor has Q8_1 (9), a dot-product
// intermediate never stored in files whose block size has changed over time.
constexpr GgmlType kGgmlTypes[] = {
    {"F32", 1, 4},        {"F16", 1, 2},       {"Q4_0", 32, 18},    {"Q4_1", 32, 20},
    {nullptr, 0, 0},      {nullptr, 0, 0},     {"Q5_0", 32, 22},    {"Q5_1", 32, 24},
    {"Q8_0", 32, 34},     {nullptr, 0, 0},     {"Q2_K", 256, 84},   {"Q3_K", 256, 110},
    {"Q4_K", 256, 144},   {"Q5_K", 256, 176},  {"Q6_K", 256, 210},  {"Q8_K", 256, 292},
    {"IQ2_XXS", 256, 66}, {"IQ2_XS", 256, 74}, {"IQ3_XXS", 256, 98}, {"IQ1_S", 256, 50},
    {"IQ4_NL", 32, 18},   {"IQ3_S", 256, 110}, {"IQ2_S", 256, 82},  {"IQ4_XS", 256, 136},
    {"I8", 1, 1},         {"I16", 1, 2},       {"I32", 1, 4},       {"I64", 1, 8},
    {"F64", 1, 8},        {"IQ1_M", 256, 56},  {"BF16", 1, 2},      {nullptr, 0, 0},
    {nullptr, 0, 0},      {nullptr, 0, 0},     {"TQ1_0", 256, 54},  {"TQ2_0", 256, 66},
    {nullptr, 0, 0},      {nullptr, 0, 0},     {nullptr, 0, 0},     {"MXFP4", 32, 17},
    {"NVFP4", 64, 36},    {"Q1_0", 128, 18},
};

const GgmlType* ggml_type_info(uint32_t t) {
  if (t >= std::size(kGgmlTypes) || kGgmlTypes[t].name == nullptr) return nullptr;
  return &kGgmlTypes[t];
}

// Bounds-checked little-endian reads over the mapping. Every failure sets `error`.
class Cursor {
 public:
  Cursor(const uint8_t* base, uint64_t size, uint64_t pos) : base_(base), size_(size), pos_(pos) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  const std::string& error() const { return error_; }

  bool fail(std::string msg) {
    error_ = std::move(msg);
    return false;
  }

  bool skip(uint64_t n, const char* what) {
    if (n > remaining())
      return fail("truncated: " + std::string(what) + " at byte " + std::to_string(pos_) +
                  " needs " + std::to_string(n) + " bytes, the file has " +
                  std::to_string(remaining()) + " left");
    pos_ += n;
    return true;
  }

  template <class T>
  bool read(T* out, const char* what) {
    const uint64_t at = pos_;
    if (!skip(sizeof(T), what)) return false;
    std::memcpy(out, base_ + at, sizeof(T));  // GGUF is little-endian, as are our targets
    return true;
  }

  // A gguf string: uint64 length + bytes. `out` may be null to skip it. A length over
  // `max_len` is refused before anything is copied.
  bool read_string(std::string* out, const char* what, uint64_t max_len = UINT64_MAX) {
    const uint64_t at = pos_;
    uint64_t len;
    if (!read(&len, what)) return false;
    if (len > max_len)
      return fail(std::string(what) + " at byte " + std::to_string(at) + " has length " +
                  std::to_string(len) + ", more than the " + std::to_string(max_len) +
                  " bytes allowed");
    if (len > remaining())
      return fail(std::string(what) + " at byte " + std::to_string(at) + " has length " +
                  std::to_string(len) + ", beyond the end of the file (" +
                  std::to_string(remaining()) + " bytes left)");
    if (out) out->assign(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return true;
  }

 private:
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_;
  std::string error_;
};

bool read_value(Cursor& c, ValueType type, int depth, Value* out);

// Reads an array header and walks its elements (checking every length), without
// decoding them. Counts are checked against the bytes left before any loop runs.
bool read_array(Cursor& c, int depth, ArrayInfo* out) {
  if (depth >= kMaxArrayDepth)
    return c.fail("arrays nested deeper than " + std::to_string(kMaxArrayDepth) +
                  " levels at byte " + std::to_string(c.pos()));
  uint32_t raw_type;
  uint64_t count;
  if (!c.read(&raw_type, "array element type") || !c.read(&count, "array count"))
    return false;
  const ValueType elem = ValueType(raw_type);
  const std::optional<uint64_t> size = fixed_size(elem);
  if (!size) return c.fail("array of unknown value type " + std::to_string(raw_type));
  const uint64_t min_elem = *size ? *size : elem == ValueType::kString ? 8 : kArrayHeaderBytes;
  if (count > c.remaining() / min_elem)
    return c.fail("array count " + std::to_string(count) + " of " + type_name(elem) +
                  " at byte " + std::to_string(c.pos()) + " cannot fit in the " +
                  std::to_string(c.remaining()) + " bytes left in the file");
  const uint64_t start = c.pos();
  if (*size) {
    if (!c.skip(count * *size, "array elements")) return false;
  } else if (elem == ValueType::kString) {
    for (uint64_t i = 0; i < count; ++i)
      if (!c.read_string(nullptr, "array string")) return false;
  } else {
    ArrayInfo nested;
    for (uint64_t i = 0; i < count; ++i)
      if (!read_array(c, depth + 1, &nested)) return false;
  }
  *out = ArrayInfo{elem, count, start, c.pos() - start};
  return true;
}

template <class T>
bool read_scalar(Cursor& c, Value* out) {
  T v;
  if (!c.read(&v, "metadata value")) return false;
  if constexpr (std::is_same_v<T, bool>) {
    out->data = v;
  } else if constexpr (std::is_floating_point_v<T>) {
    out->data = double(v);
  } else if constexpr (std::is_signed_v<T>) {
    out->data = int64_t(v);
  } else {
    out->data = uint64_t(v);
  }
  return true;
}

bool read_value(Cursor& c, ValueType type, int depth, Value* out) {
  out->type = type;
  switch (type) {
    case ValueType::kUInt8: return read_scalar<uint8_t>(c, out);
    case ValueType::kInt8: return read_scalar<int8_t>(c, out);
    case ValueType::kUInt16: return read_scalar<uint16_t>(c, out);
    case ValueType::kInt16: return read_scalar<int16_t>(c, out);
    case ValueType::kUInt32: return read_scalar<uint32_t>(c, out);
    case ValueType::kInt32: return read_scalar<int32_t>(c, out);
    case ValueType::kFloat32: return read_scalar<float>(c, out);
    case ValueType::kUInt64: return read_scalar<uint64_t>(c, out);
    case ValueType::kInt64: return read_scalar<int64_t>(c, out);
    case ValueType::kFloat64: return read_scalar<double>(c, out);
    case ValueType::kBool: {
      uint8_t b;
      if (!c.read(&b, "metadata value")) return false;
      out->data = b != 0;
      return true;
    }
    case ValueType::kString: {
      std::string s;
      if (!c.read_string(&s, "metadata string")) return false;
      out->data = std::move(s);
      return true;
    }
    case ValueType::kArray: {
      ArrayInfo a;
      if (!read_array(c, depth, &a)) return false;
      out->data = a;
      return true;
    }
  }
  return c.fail("unknown value type " + std::to_string(uint32_t(type)));
}

// A key or name for an error message: cut, and non-printable bytes shown as '?'.
std::string quote(const std::string& s) {
  std::string q = s.substr(0, kQuoteBytes);
  for (char& c : q)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  return "\"" + q + (s.size() > kQuoteBytes ? "...\"" : "\"");
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

}  // namespace

std::string type_name(ValueType type) {
  static const char* const kNames[] = {"UINT8", "INT8", "UINT16", "INT16", "UINT32",
                                       "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
                                       "UINT64", "INT64", "FLOAT64"};
  const auto i = uint32_t(type);
  return i < std::size(kNames) ? kNames[i] : "type " + std::to_string(i);
}

std::string ggml_type_name(uint32_t t) {
  const GgmlType* info = ggml_type_info(t);
  return info ? info->name : "type " + std::to_string(t);
}

File::~File() { close(); }

File::File(File&& other) noexcept { *this = std::move(other); }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    close();
    base_ = std::exchange(other.base_, nullptr);
    mapped_ = std::exchange(other.mapped_, false);
    size_ = std::exchange(other.size_, 0);
    version_ = other.version_;
    alignment_ = other.alignment_;
    data_offset_ = other.data_offset_;
    metadata_ = std::move(other.metadata_);
    key_index_ = std::move(other.key_index_);
    tensors_ = std::move(other.tensors_);
  }
  return *this;
}

void File::close() {
  if (base_ && mapped_) munmap(const_cast<uint8_t*>(base_), size_);
  mapped_ = false;
  base_ = nullptr;
  size_ = 0;
  version_ = 0;
  alignment_ = kDefaultAlignment;
  data_offset_ = 0;
  metadata_.clear();
  key_index_.clear();
  tensors_.clear();
}

bool File::open(const std::string& path, std::string* err) {
  close();
  std::string msg;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0) {
    msg = std::strerror(errno);
  } else if (!S_ISREG(st.st_mode)) {
    msg = "not a regular file";
  } else if (st.st_size < 4) {
    msg = "too small to be a GGUF file (" + std::to_string(st.st_size) + " bytes)";
  } else {
    void* p = mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      msg = std::string("mmap failed: ") + std::strerror(errno);
    } else {
      base_ = static_cast<const uint8_t*>(p);
      size_ = uint64_t(st.st_size);
      mapped_ = true;
    }
  }
  if (fd >= 0) ::close(fd);  // the mapping stays valid without the descriptor
  if (base_ && !checked_parse(&msg)) close();
  if (base_) return true;
  if (err) *err = path + ": " + msg;
  return false;
}

bool File::open_memory(const void* data, size_t size, std::string* err) {
  close();
  if (size < 4) {
    if (err) *err = "too small to be a GGUF file (" + std::to_string(size) + " bytes)";
    return false;
  }
  base_ = static_cast<const uint8_t*>(data);
  size_ = size;
  std::string msg;
  if (checked_parse(&msg)) return true;
  close();
  if (err) *err = msg;
  return false;
}

bool File::checked_parse(std::string* msg) {
  try {
    return parse(msg);
  } catch (const std::bad_alloc&) {
    *msg = "out of memory while reading the metadata";
  } catch (const std::length_error&) {
    *msg = "out of memory while reading the metadata";
  }
  return false;
}

bool File::parse(std::string* err) {
  if (std::memcmp(base_, "GGUF", 4) != 0) {
    std::string found;
    for (int i = 0; i < 4; ++i) {
      const unsigned char ch = base_[i];
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", ch);
      found += (ch >= 0x20 && ch < 0x7f) ? std::string(1, char(ch)) : std::string(hex);
    }
    *err = "bad magic: expected \"GGUF\", found \"" + found + "\"; not a GGUF file";
    return false;
  }
  Cursor c(base_, size_, 4);
  const auto cursor_failed = [&](const std::string& context) {
    *err = c.error() + context;
    return false;
  };
  uint64_t n_tensors = 0, n_kv = 0;
  if (!c.read(&version_, "header version")) return cursor_failed("");
  if (version_ != 2 && version_ != 3) {
    *err = "unsupported GGUF version " + std::to_string(version_) + " (supported: 2, 3)";
    if (__builtin_bswap32(version_) == 2 || __builtin_bswap32(version_) == 3)
      *err += "; this looks like a big-endian GGUF, which is not supported";
    return false;
  }
  if (!c.read(&n_tensors, "header tensor count") || !c.read(&n_kv, "header metadata count"))
    return cursor_failed("");
  if (n_kv > c.remaining() / kMinKeyValueBytes || n_kv > kMaxKeyValues) {
    *err = "header claims " + std::to_string(n_kv) + " metadata pairs, more than the " +
           std::to_string(c.remaining()) + " bytes left in the file can hold (or the limit of " +
           std::to_string(kMaxKeyValues) + ")";
    return false;
  }

  metadata_.reserve(n_kv);
  for (uint64_t i = 0; i < n_kv; ++i) {
    KeyValue kv;
    uint32_t raw_type;
    if (!c.read_string(&kv.key, "metadata key", kMaxKeyBytes) ||
        !c.read(&raw_type, "metadata value type") ||
        !read_value(c, ValueType(raw_type), 0, &kv.value))
      return cursor_failed(" (metadata pair " + std::to_string(i) +
                           (kv.key.empty() ? "" : ", key " + quote(kv.key)) + ")");
    if (!key_index_.emplace(kv.key, metadata_.size()).second) {
      *err = "duplicate metadata key " + quote(kv.key);
      return false;
    }
    metadata_.push_back(std::move(kv));
  }

  if (const Value* a = find("general.alignment")) {
    const auto* v = std::get_if<uint64_t>(&a->data);
    if (a->type != ValueType::kUInt32 || !v || *v == 0 || (*v & (*v - 1)) != 0) {
      *err = "general.alignment must be a UINT32 power of two";
      return false;
    }
    alignment_ = *v;
  }

  if (n_tensors > c.remaining() / kMinTensorInfoBytes || n_tensors > kMaxTensors) {
    *err = "header claims " + std::to_string(n_tensors) + " tensors, more than the " +
           std::to_string(c.remaining()) + " bytes left in the file can describe (or the " +
           "limit of " + std::to_string(kMaxTensors) + ")";
    return false;
  }
  tensors_.reserve(n_tensors);
  std::unordered_set<std::string> names;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo t;
    uint32_t n_dims;
    const auto where = [&] {
      return " (tensor " + std::to_string(i) + (t.name.empty() ? "" : " " + quote(t.name)) + ")";
    };
    if (!c.read_string(&t.name, "tensor name", kMaxTensorNameBytes) ||
        !c.read(&n_dims, "tensor dimension count"))
      return cursor_failed(where());
    if (n_dims > kMaxDims) {
      *err = "tensor has " + std::to_string(n_dims) + " dimensions, at most " +
             std::to_string(kMaxDims) + " are allowed" + where();
      return false;
    }
    t.dims.resize(n_dims);
    t.n_elements = 1;
    for (uint64_t& d : t.dims) {
      if (!c.read(&d, "tensor dimension")) return cursor_failed(where());
      if (d > uint64_t(std::numeric_limits<int64_t>::max()) ||
          !checked_mul(t.n_elements, d, &t.n_elements) ||
          t.n_elements > uint64_t(std::numeric_limits<int64_t>::max())) {
        *err = "tensor element count overflows" + where();
        return false;
      }
    }
    if (!c.read(&t.ggml_type, "tensor type") || !c.read(&t.offset, "tensor offset"))
      return cursor_failed(where());
    if (t.offset % alignment_ != 0) {
      *err = "tensor offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(alignment_) + where();
      return false;
    }
    if (const GgmlType* g = ggml_type_info(t.ggml_type)) {
      if (n_dims > 0 && t.dims[0] % g->block != 0) {
        *err = "tensor row of " + std::to_string(t.dims[0]) + " elements is not a multiple of " +
               g->name + "'s block of " + std::to_string(g->block) + where();
        return false;
      }
      uint64_t n_bytes;
      if (!checked_mul(t.n_elements / g->block, g->bytes, &n_bytes)) {
        *err = "tensor byte size overflows" + where();
        return false;
      }
      t.n_bytes = n_bytes;
    }
    if (!names.insert(t.name).second) {
      *err = "duplicate tensor name " + quote(t.name);
      return false;
    }
    tensors_.push_back(std::move(t));
  }

  data_offset_ = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t data_bytes = data_offset_ <= size_ ? size_ - data_offset_ : 0;
  for (const TensorInfo& t : tensors_) {
    if (!t.n_bytes) continue;
    if (t.offset > data_bytes || *t.n_bytes > data_bytes - t.offset) {
      *err = "tensor " + quote(t.name) + " (" + std::to_string(*t.n_bytes) + " bytes at data offset " +
             std::to_string(t.offset) + ") extends past the end of the file; truncated?";
      return false;
    }
  }
  return true;
}

const Value* File::find(std::string_view key) const {
  const auto it = key_index_.find(std::string(key));
  return it == key_index_.end() ? nullptr : &metadata_[it->second].value;
}

std::optional<std::string> File::get_string(std::string_view key) const {
  const Value* v = find(key);
  const auto* s = v ? std::get_if<std::string>(&v->data) : nullptr;
  return s ? std::optional(*s) : std::nullopt;
}

std::optional<uint64_t> File::get_uint(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (const auto* u = std::get_if<uint64_t>(&v->data)) return *u;
  if (const auto* i = std::get_if<int64_t>(&v->data); i && *i >= 0) return uint64_t(*i);
  return std::nullopt;
}

std::optional<int64_t> File::get_int(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (const auto* i = std::get_if<int64_t>(&v->data)) return *i;
  if (const auto* u = std::get_if<uint64_t>(&v->data);
      u && *u <= uint64_t(std::numeric_limits<int64_t>::max()))
    return int64_t(*u);
  return std::nullopt;
}

std::optional<double> File::get_float(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (const auto* d = std::get_if<double>(&v->data)) return *d;
  if (const auto* u = std::get_if<uint64_t>(&v->data)) return double(*u);
  if (const auto* i = std::get_if<int64_t>(&v->data)) return double(*i);
  return std::nullopt;
}

std::optional<bool> File::get_bool(std::string_view key) const {
  const Value* v = find(key);
  const auto* b = v ? std::get_if<bool>(&v->data) : nullptr;
  return b ? std::optional(*b) : std::nullopt;
}

std::optional<ArrayInfo> File::get_array(std::string_view key) const {
  const Value* v = find(key);
  const auto* a = v ? std::get_if<ArrayInfo>(&v->data) : nullptr;
  return a ? std::optional(*a) : std::nullopt;
}

// The decoders re-walk ranges open() already validated; the cursor still checks bounds,
// so an ArrayInfo that did not come from this file fails instead of reading past the map.
std::optional<std::vector<std::string>> File::strings(const ArrayInfo& a) const {
  if (!base_ || a.elem_type != ValueType::kString) return std::nullopt;
  Cursor c(base_, size_, std::min(a.offset, size_));
  std::vector<std::string> out(a.count <= c.remaining() / 8 ? a.count : 0);
  for (std::string& s : out)
    if (!c.read_string(&s, "array string")) return std::nullopt;
  if (out.size() != a.count) return std::nullopt;
  return out;
}

std::optional<std::vector<int64_t>> File::ints(const ArrayInfo& a) const {
  const std::optional<uint64_t> size = fixed_size(a.elem_type);
  if (!base_ || !size || *size == 0 || a.elem_type == ValueType::kBool ||
      a.elem_type == ValueType::kFloat32 || a.elem_type == ValueType::kFloat64)
    return std::nullopt;
  Cursor c(base_, size_, std::min(a.offset, size_));
  if (a.count > c.remaining() / *size) return std::nullopt;
  std::vector<int64_t> out(a.count);
  for (int64_t& x : out) {
    Value v;
    if (!read_value(c, a.elem_type, 0, &v)) return std::nullopt;
    if (const auto* i = std::get_if<int64_t>(&v.data)) {
      x = *i;
    } else {
      const uint64_t u = std::get<uint64_t>(v.data);
      if (u > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
      x = int64_t(u);
    }
  }
  return out;
}

std::optional<std::vector<double>> File::floats(const ArrayInfo& a) const {
  if (!base_ || (a.elem_type != ValueType::kFloat32 && a.elem_type != ValueType::kFloat64))
    return std::nullopt;
  const uint64_t size = *fixed_size(a.elem_type);
  Cursor c(base_, size_, std::min(a.offset, size_));
  if (a.count > c.remaining() / size) return std::nullopt;
  std::vector<double> out(a.count);
  for (double& x : out) {
    Value v;
    if (!read_value(c, a.elem_type, 0, &v)) return std::nullopt;
    x = std::get<double>(v.data);
  }
  return out;
}

std::optional<std::vector<ArrayInfo>> File::arrays(const ArrayInfo& a) const {
  if (!base_ || a.elem_type != ValueType::kArray) return std::nullopt;
  Cursor c(base_, size_, std::min(a.offset, size_));
  if (a.count > c.remaining() / kArrayHeaderBytes) return std::nullopt;
  std::vector<ArrayInfo> out(a.count);
  for (ArrayInfo& nested : out)
    if (!read_array(c, 1, &nested)) return std::nullopt;
  return out;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  for (const TensorInfo& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const uint8_t* File::tensor_data(const TensorInfo& t) const {
  if (!base_ || data_offset_ > size_ || t.offset > size_ - data_offset_) return nullptr;
  return base_ + data_offset_ + t.offset;
}

}  // namespace gguf
