// The prompts of kvgc-bench-quality's retrieval and perplexity tasks, as kvgc's token ids
// (the same ids go to the anchors: bench/anchors/, through export_tasks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "quality_common.hpp"

namespace quality {

// The passkey task's text (Landmark Attention's): the intro, and the filler sentence
// repeated around the keys (kvgc-bench-serve builds its shared-prefix prompts from them).
inline constexpr const char* kPasskeyIntro =
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important information there.\n";
inline constexpr const char* kPasskeyFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
    "again. ";

struct Prompt {
  std::string id;               // "passkey/1024/0.10": task, context asked for, depth
  std::vector<int32_t> tokens;
  size_t context = 0;           // index into RetrievalTask::contexts
  double depth = 0;
  std::string expect;           // lowercase; the greedy answer must contain it
  // expect is hyphenated words ("amber-falcon-river"): the answer may separate them by
  // hyphens or spaces.
  bool word_key = false;
  size_t cell = 0;              // index into RetrievalTask::cells (tasks that have cells)
  // 0: the question is in the prompt, compressed with it. Else where the question starts:
  // tokens before it are prefilled and compressed, then the rest is read (kvpress's
  // setting, and an engine's that caches a document for questions to come).
  uint32_t question_at = 0;
};

// Whether a greedy answer holds the prompt's key: case-insensitive containment, and for
// word keys any run of hyphens and blanks in the answer reads as one hyphen.
bool answer_has_key(const std::string& answer, const Prompt& prompt);

struct RetrievalTask {
  std::string name;
  std::string description;      // one line for the table's heading
  uint32_t answer_tokens = 8;   // greedy tokens decoded at most
  bool stream_rows = false;     // also measured with stream prefill (unless --observe-only)
  std::vector<uint32_t> contexts;
  std::vector<Prompt> prompts;
  // Tasks reported per cell as well ("kinds": "TEXT/FORMAT"); empty for the others.
  std::vector<std::string> cells;
};
bool build_retrieval_task(const Bench& bench, const std::string& name, RetrievalTask* out,
                          std::string* err);

// The "kinds" task (bench/quality_kinds.cpp): prompt kinds nobody tuned for, texts x key
// formats, each prompt its own key, excerpt and depth. question_after: "kinds-after", the
// same prompts with the question read after the context is compressed.
bool build_kinds_task(const Bench& bench, bool question_after, RetrievalTask* out,
                      std::string* err);

// The prompt lengths of a retrieval task: --contexts, else the mode's (quick or full),
// each capped so that prompt + answer stays inside the model's trained context.
std::vector<uint32_t> retrieval_contexts(const Bench& bench, uint32_t answer_tokens,
                                         const std::string& task,
                                         const std::vector<uint32_t>& quick,
                                         const std::vector<uint32_t>& full);

// A text's paragraphs (split at blank lines).
std::vector<std::string> paragraphs(const std::string& text);

// A chat prompt of about `target` tokens: an excerpt of `paras` from paragraph `first` on
// (wrapping to the text's start at most once), `sentence` as a paragraph of its own at the
// boundary nearest `depth`, then `question`; the assistant's turn starts empty. With
// question_at, the context (up to the question's blank line) and the rest are encoded
// apart and *question_at receives where the rest starts.
std::vector<int32_t> prose_prompt(const engine::Tokenizer& tokenizer,
                                  const std::vector<std::string>& paras, size_t first,
                                  const std::string& text_name, const std::string& sentence,
                                  const std::string& question, uint32_t target, double depth,
                                  uint32_t* question_at = nullptr);

// Prefix perplexity: `prefix` tokens of prose, compressed, then tokens [score_from, end)
// each predicted from the position before it (score_from = prefix + 1: the continuation's
// first token is predicted by the prefill's own, pre-eviction logits, the same for every
// configuration, so it is not scored).
struct PplPrompt {
  std::string id;               // "ppl-prefix/1024@0"
  std::vector<int32_t> tokens;
  uint32_t prefix = 0;
  uint32_t score_from = 0;
};
bool build_prefix_ppl(const Bench& bench, std::vector<PplPrompt>* out, std::string* err);
// The streaming perplexity's text: 4096 (quick 1024) scored tokens + 1.
bool stream_ppl_tokens(const Bench& bench, std::vector<int32_t>* tokens, std::string* err);

// The passkey task's prompt (a 5-digit key at `depth` in synthetic filler of about
// `target` tokens, then "What is the pass key? The pass key is"); *expect gets the key.
// kvgc-bench-quality's passkey prompts and kvgc-bench-serve's passkey requests.
std::vector<int32_t> passkey_prompt(const engine::Tokenizer& tokenizer, uint32_t target,
                                    double depth, std::string* expect);

// The ids that end an answer: <|im_end|>, <|endoftext|>, eos.
std::vector<int32_t> stop_tokens(const engine::Tokenizer& tokenizer);

}  // namespace quality
