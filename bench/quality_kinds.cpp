// The "kinds" retrieval task (issue 45): the prompt kinds users wrote, not the ones kvgc
// was tuned on. Cells are texts x key formats; every prompt of a cell has its own key
// (seeded from its id), its own stretch of the text and its own depth (spread evenly over
// 0.05..0.95 in a seeded order), then the question in the user turn of a chat prompt.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "quality_tasks.hpp"

namespace quality {
namespace {

struct Text {
  const char* file;  // in KVGC_QUALITY_DATA_DIR, with ".txt"
  const char* name;  // how the prompt names the excerpt
};
// jargon-intro is the text kvgc was tuned on; the others it was not (see
// bench/quality_data/README.md).
constexpr Text kTexts[] = {
    {"jargon-intro", "the Jargon File"},
    {"debian-policy", "the Debian Policy Manual"},
    {"ninja-manual", "the manual of the Ninja build system"},
};

enum class Format { Digits, Words, Id };
struct KeyFormat {
  Format format;
  const char* name;
  const char* sentence;  // "%s": the key
  const char* question;
};
constexpr KeyFormat kFormats[] = {
    {Format::Digits, "digits", "The five-digit pass number is %s.",
     "What is the five-digit pass number?"},
    {Format::Words, "words", "The secret code word is %s.", "What is the secret code word?"},
    {Format::Id, "id", "The access id is %s.", "What is the access id?"},
};

// Plain words, one or two tokens each, none of them likely in the texts' own jargon.
constexpr const char* kWords[] = {
    "amber",  "falcon", "river",  "copper", "meadow", "harbor", "cedar",  "lantern",
    "violet", "badger", "canyon", "maple",  "ember",  "glacier", "orchid", "pepper",
    "willow", "tiger",  "saddle", "marble", "thunder", "walnut", "coral",  "hollow",
    "silver", "otter",  "prairie", "crimson", "lemon", "forest", "quartz", "raven",
    "summit", "velvet", "basil",  "comet",  "desert", "garnet", "island", "jasmine",
};
constexpr size_t kNumWords = sizeof kWords / sizeof kWords[0];
// Id letters: no I or O (read as 1 and 0).
constexpr const char kLetters[] = "ABCDEFGHJKLMNPQRSTUVWXYZ";

// A reproducible stream from a string (splitmix64 over its FNV-1a hash): the standard
// library's distributions differ between implementations, these numbers do not.
class Rng {
 public:
  explicit Rng(const std::string& seed) {
    for (const unsigned char c : seed) state_ = (state_ ^ c) * 0x100000001b3ull;
  }
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return size_t(next() % n); }

 private:
  uint64_t state_ = 0xcbf29ce484222325ull;
};

// The key as the prompt writes it.
std::string make_key(Format format, Rng* rng) {
  switch (format) {
    case Format::Digits:
      return std::to_string(10000 + rng->below(90000));
    case Format::Words: {
      size_t w[3];
      for (size_t i = 0; i < 3; ++i) {
        do w[i] = rng->below(kNumWords);
        while (std::find(w, w + i, w[i]) != w + i);
      }
      return std::string(kWords[w[0]]) + "-" + kWords[w[1]] + "-" + kWords[w[2]];
    }
    case Format::Id: {
      const size_t n = sizeof kLetters - 1;
      const char a = kLetters[rng->below(n)], b = kLetters[rng->below(n)];
      const unsigned number = unsigned(1000 + rng->below(9000));
      const char c = kLetters[rng->below(n)], d = kLetters[rng->below(n)];
      char id[16];
      std::snprintf(id, sizeof id, "%c%c-%u-%c%c", a, b, number, c, d);
      return id;
    }
  }
  return {};
}

std::string fill(const char* format, const std::string& key) {
  std::string s = format;
  return s.replace(s.find("%s"), 2, key);
}

}  // namespace

bool build_kinds_task(const Bench& bench, bool question_after, RetrievalTask* out,
                      std::string* err) {
  const engine::Tokenizer& tok = *bench.tokenizer;
  out->name = question_after ? "kinds-after" : "kinds";
  out->prompts.clear();
  out->cells.clear();
  // Room for a sentence around the key ("The secret code word is ...").
  out->answer_tokens = 24;
  out->stream_rows = false;
  // Quick: 3 prompts a cell at ~1K; full: the 20 a cell at ~4K and ~8K.
  const size_t per_cell = bench.prompts_per_cell ? bench.prompts_per_cell : bench.full ? 20 : 3;
  out->contexts = retrieval_contexts(bench, out->answer_tokens, "kinds", {1024}, {4096, 8192});
  out->description = std::to_string(std::size(kTexts)) + " texts x " +
                     std::to_string(std::size(kFormats)) + " key formats (5 digits, three "
                     "hyphenated words, an id like KX-4471-QB), " + std::to_string(per_cell) +
                     " prompts a cell and length, each its own key, excerpt and depth "
                     "(0.05..0.95), asked for in a chat prompt" +
                     (question_after ? std::string(" after the context is compressed")
                                     : std::string(" compressed with the context"));
  for (const Text& text : kTexts) {
    std::string body;
    if (!read_text(std::string(KVGC_QUALITY_DATA_DIR) + "/" + text.file + ".txt", &body, err))
      return false;
    const std::vector<std::string> paras = paragraphs(body);
    for (size_t f = 0; f < std::size(kFormats); ++f) {
      const KeyFormat& kf = kFormats[f];
      const std::string cell = std::string(text.file) + "/" + kf.name;
      out->cells.push_back(cell);
      for (size_t c = 0; c < out->contexts.size(); ++c) {
        const uint32_t context = out->contexts[c];
        // Depths evenly over 0.05..0.95, dealt in a seeded order so that depth does not
        // follow the excerpt's place in the text.
        std::vector<double> depths(per_cell, 0.5);
        for (size_t i = 0; per_cell > 1 && i < per_cell; ++i)
          depths[i] = 0.05 + 0.9 * double(i) / double(per_cell - 1);
        Rng order("kinds/" + cell + "/" + std::to_string(context));
        for (size_t i = per_cell; i > 1; --i) std::swap(depths[i - 1], depths[order.below(i)]);
        for (size_t i = 0; i < per_cell; ++i) {
          // Seeded by the kinds id: both placements ask the same prompts.
          char id[160];
          std::snprintf(id, sizeof id, "kinds/%s/%u/%02zu", cell.c_str(), context, i);
          Rng rng(id);
          const std::string key = make_key(kf.format, &rng);
          // Excerpts start evenly over the text, shifted per format so that the cells of
          // one text do not read the same stretches.
          const size_t first =
              (i * paras.size() + f * paras.size() / std::size(kFormats)) / per_cell %
              paras.size();
          Prompt p;
          p.id = out->name + (id + 5);
          p.context = c;
          p.cell = out->cells.size() - 1;
          p.depth = depths[i];
          p.expect = lower(key);
          p.word_key = kf.format == Format::Words;
          p.tokens = prose_prompt(tok, paras, first, text.name, fill(kf.sentence, key),
                                  kf.question, context, p.depth,
                                  question_after ? &p.question_at : nullptr);
          // The key must survive tokenization whole: the prompt, decoded, holds it.
          if (!answer_has_key(tok.decode(p.tokens), p)) {
            *err = std::string("kinds: prompt ") + id + " lost its key " + key;
            return false;
          }
          out->prompts.push_back(std::move(p));
        }
      }
    }
  }
  return true;
}

}  // namespace quality
