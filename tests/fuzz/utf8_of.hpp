// One code point below U+0800 as UTF-8 (GPT-2's byte stand-ins never need more): shared
// by the test vocabularies (tiny_gguf.hpp) and the reference merge (tokenizer_reference.hpp).
#pragma once

#include <cstdint>
#include <string>

namespace kvgc_test {

inline std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else {
    s += char(0xc0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3f));
  }
  return s;
}

}  // namespace kvgc_test
