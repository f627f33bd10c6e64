// A read-only GGUF (v2/v3) reader: header, metadata and tensor infos.
//
// The file is memory-mapped and validated once in open(): every length, count and
// offset is checked against the file size (and against caps: 65,536 metadata pairs and
// tensors, 64 KiB keys) before it is used, so a hostile file yields an error message,
// never a crash or a huge allocation: open() allocates at most a few MiB beyond what
// the file's own strings copy (tests/parser_peak.cpp measures it). Scalars and strings are copied
// out; arrays are recorded by element type, count and file offset and decoded on
// demand, so a 150K-entry tokenizer vocabulary costs nothing unless asked for.
// Tensor data stays in the mapping: a model loader takes tensor_data() pointers.
// Hand-written: Debian bookworm has no package that reads GGUF (no ggml or gguf package;
// ggml's reader is part of llama.cpp, which kvgc does not vendor), and the format is a
// flat length-prefixed layout.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

namespace gguf {

enum class ValueType : uint32_t {
  kUInt8 = 0,
  kInt8 = 1,
  kUInt16 = 2,
  kInt16 = 3,
  kUInt32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUInt64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// "UINT32", "STRING", ...; "type 99" for values outside the enum.
std::string type_name(ValueType type);

// An array value: where its elements lie in the file. Elements are decoded on demand.
struct ArrayInfo {
  ValueType elem_type = ValueType::kUInt8;
  uint64_t count = 0;
  uint64_t offset = 0;  // file offset of the first element
  uint64_t bytes = 0;   // size of the elements in the file
};

// One metadata value. Unsigned integers are widened to uint64_t, signed ones to int64_t,
// floats to double; `type` keeps the type the file declared.
struct Value {
  ValueType type = ValueType::kUInt8;
  std::variant<uint64_t, int64_t, double, bool, std::string, ArrayInfo> data;
};

struct KeyValue {
  std::string key;
  Value value;
};

struct TensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // ne[0] first (the contiguous dimension), as in ggml
  uint32_t ggml_type = 0;
  uint64_t offset = 0;         // from the start of the data section
  uint64_t n_elements = 0;
  std::optional<uint64_t> n_bytes;  // known for the ggml types this reader has sizes for
};

// Name of a ggml tensor type ("F16", "Q4_K", ...) or "type N" if unknown.
std::string ggml_type_name(uint32_t ggml_type);

class File {
 public:
  File() = default;
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // Maps and validates `path`. On failure returns false, *err (if not null) says why,
  // prefixed with the path, and the File is left closed.
  bool open(const std::string& path, std::string* err);
  // The same over bytes the caller owns (and keeps alive while the File is open): for
  // tests and the fuzzer. Errors are not prefixed.
  bool open_memory(const void* data, size_t size, std::string* err);
  void close();
  bool is_open() const { return base_ != nullptr; }

  uint32_t version() const { return version_; }
  uint64_t file_size() const { return size_; }
  uint64_t alignment() const { return alignment_; }
  // Offset of the tensor data section: the end of the tensor infos, aligned.
  uint64_t data_offset() const { return data_offset_; }

  const std::vector<KeyValue>& metadata() const { return metadata_; }
  const Value* find(std::string_view key) const;

  // Typed getters: nullopt if the key is missing or its value does not convert exactly.
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<uint64_t> get_uint(std::string_view key) const;  // any non-negative int
  std::optional<int64_t> get_int(std::string_view key) const;    // any int that fits
  std::optional<double> get_float(std::string_view key) const;   // floats and ints
  std::optional<bool> get_bool(std::string_view key) const;
  std::optional<ArrayInfo> get_array(std::string_view key) const;

  // Array decoders: nullopt if the elements are not of the requested kind.
  std::optional<std::vector<std::string>> strings(const ArrayInfo& array) const;
  std::optional<std::vector<int64_t>> ints(const ArrayInfo& array) const;  // all int types
  std::optional<std::vector<double>> floats(const ArrayInfo& array) const;
  std::optional<std::vector<ArrayInfo>> arrays(const ArrayInfo& array) const;  // nested

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  // The tensor's bytes inside the mapping (valid while the File is open).
  const uint8_t* tensor_data(const TensorInfo& tensor) const;

 private:
  bool parse(std::string* err);
  bool checked_parse(std::string* err);  // parse(), with bad_alloc as an error message

  const uint8_t* base_ = nullptr;
  bool mapped_ = false;  // base_ is our mapping (open), not the caller's bytes (open_memory)
  uint64_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<KeyValue> metadata_;
  std::unordered_map<std::string, size_t> key_index_;
  std::vector<TensorInfo> tensors_;
};

}  // namespace gguf
