// libFuzzer harness over the GGUF reader: arbitrary bytes opened as a GGUF file, then
// everything a loader asks of it: the model shape (kvgc-plan's path), every metadata
// getter, every array decoded (strings, ints, floats, nested), every tensor's data
// pointer checked to lie inside the input. Any error is fine; a crash, a sanitizer
// report, an out-of-bounds tensor or a leak is not.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "gguf.hpp"
#include "model_shape.hpp"

namespace {

void decode(const gguf::File& f, const gguf::ArrayInfo& a, int depth) {
  (void)f.strings(a);
  (void)f.ints(a);
  (void)f.floats(a);
  if (depth < 3)
    if (auto nested = f.arrays(a))
      for (const gguf::ArrayInfo& n : *nested) decode(f, n, depth + 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gguf::File f;
  std::string err;
  if (!f.open_memory(data, size, &err)) {
    if (err.empty()) std::abort();  // every refusal says why
    return 0;
  }
  kvgc_tools::ModelShape shape;
  (void)kvgc_tools::shape_from_gguf(f, "fuzz", &shape, &err);
  for (const gguf::KeyValue& kv : f.metadata()) {
    (void)f.get_string(kv.key);
    (void)f.get_uint(kv.key);
    (void)f.get_int(kv.key);
    (void)f.get_float(kv.key);
    (void)f.get_bool(kv.key);
    if (auto a = f.get_array(kv.key)) decode(f, *a, 0);
  }
  for (const gguf::TensorInfo& t : f.tensors()) {
    const uint8_t* p = f.tensor_data(t);
    if (!p) continue;
    if (p < data || p > data + size ||
        (t.n_bytes && *t.n_bytes > size_t(data + size - p))) {
      std::fprintf(stderr, "tensor %s lies outside the file\n", t.name.c_str());
      std::abort();
    }
  }
  return 0;
}
