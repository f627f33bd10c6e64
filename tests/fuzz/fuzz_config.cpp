// libFuzzer harness over the config.json reader: arbitrary bytes as a document, read for
// the members a model shape needs (root and text_config) and for a few paths of its
// own; then the shape. Any error is fine (it must name a line and column); a crash, a
// sanitizer report or a leak is not.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "json.hpp"
#include "model_shape.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  json::Document doc;
  std::string err;
  static const std::vector<json::Path> paths = {{"a"}, {"a", "b"}, {"a", "b", "c"}, {""}};
  if (!json::parse(text, paths, &doc, &err)) {
    if (err.rfind("line ", 0) != 0) std::abort();  // errors carry a position
  }
  kvgc_tools::ModelShape shape;
  (void)kvgc_tools::shape_from_config_text(text, "fuzz", &shape, &err);
  return 0;
}
