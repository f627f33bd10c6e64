// The tasks' prompts. Passkey-style tasks hide keys in synthetic filler; needle tasks hide a
// sentence in real prose and ask for it in a chat prompt. kvgc was tuned on the passkey
// (digits) and the Jargon File needle only: passkey-word, multikey and needle2 (another
// text, another needle) are the tasks it was not.
#include "quality_tasks.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>

namespace quality {
namespace {

// Prompt lengths and the depths measured at each.
struct Grid {
  uint32_t context;
  std::vector<double> depths;
};

const std::vector<double> kNineDepths = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9};

// Quick: ~1K at 3 depths; full: the issue's grid, 1K/2K/4K x 9 depths; or --contexts /
// --depths.
std::vector<Grid> grid(const Bench& bench, uint32_t answer_tokens, const std::string& task) {
  std::vector<double> depths = bench.full ? kNineDepths : std::vector<double>{0.1, 0.5, 0.9};
  if (!bench.depths.empty()) depths = bench.depths;
  std::vector<Grid> g;
  for (const uint32_t c : retrieval_contexts(bench, answer_tokens, task, {1024}, {1024, 2048, 4096}))
    g.push_back({c, depths});
  return g;
}

std::string prompt_id(const std::string& task, uint32_t context, double depth) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s/%u/%.2f", task.c_str(), context, depth);
  return buf;
}

// ---- passkey-style: keys in synthetic filler ----------------------------------------

constexpr const char* kIntro = kPasskeyIntro;
constexpr const char* kFiller = kPasskeyFiller;

// Sentences inserted into the filler, each at its depth, then the question.
struct Inserted {
  std::string sentence;
  double depth;
};
std::vector<int32_t> filler_prompt(const engine::Tokenizer& tokenizer, uint32_t target,
                                   std::vector<Inserted> inserts, const std::string& question) {
  std::string fixed_text = std::string(kIntro) + question;
  for (const Inserted& s : inserts) fixed_text += s.sentence;
  const size_t fixed = tokenizer.encode(fixed_text).size();
  const size_t per_filler = tokenizer.encode(kFiller).size();
  const size_t n_filler = target > fixed ? (target - fixed) / per_filler : 1;
  std::stable_sort(inserts.begin(), inserts.end(),
                   [](const Inserted& a, const Inserted& b) { return a.depth < b.depth; });
  std::string text = kIntro;
  size_t next = 0;
  for (size_t i = 0; i <= n_filler; ++i) {
    while (next < inserts.size() &&
           size_t(std::lround(inserts[next].depth * double(n_filler))) <= i)
      text += inserts[next++].sentence;
    if (i < n_filler) text += kFiller;
  }
  while (next < inserts.size()) text += inserts[next++].sentence;
  return tokenizer.encode(text + question);
}

constexpr const char* kPasskey = "71432";
constexpr const char* kPassword = "marmalade";
struct ColourKey {
  const char* colour;
  const char* key;
};
constexpr ColourKey kColourKeys[] = {{"red", "38514"}, {"green", "60927"}, {"blue", "14283"}};

// ---- needles in prose -----------------------------------------------------------------

struct Needle {
  const char* text_name;  // how the prompt names the excerpt
  const char* needle;
  const char* question;
  const char* answer;
};
constexpr Needle kJargonNeedle = {"the Jargon File",
                                  "The secret ingredient of the porridge is cardamom.",
                                  "What is the secret ingredient of the porridge?", "cardamom"};
constexpr Needle kPolicyNeedle = {"the Debian Policy Manual",
                                  "The lighthouse keeper's favourite colour is vermilion.",
                                  "What is the lighthouse keeper's favourite colour?",
                                  "vermilion"};

}  // namespace

std::vector<std::string> paragraphs(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find("\n\n", at);
    if (end == std::string::npos) end = text.size();
    std::string p = text.substr(at, end - at);
    while (!p.empty() && (p.back() == '\n' || p.back() == ' ')) p.pop_back();
    if (!p.empty()) out.push_back(p);
    at = end + 2;
  }
  return out;
}

// The assistant's turn starts empty: the answer's words (not only its first token, which
// the prefill computes before any eviction) come from the evicted cache.
std::vector<int32_t> prose_prompt(const engine::Tokenizer& tokenizer,
                                  const std::vector<std::string>& paras, size_t first,
                                  const std::string& text_name, const std::string& sentence,
                                  const std::string& question_text, uint32_t target,
                                  double depth, uint32_t* question_at) {
  const std::string task = "Below is an excerpt from " + text_name +
                           ". Read it carefully, then answer the question that follows it.\n\n";
  const std::string question = "\n\nQuestion: " + question_text;
  auto wrap = [&](const std::string& prose) {
    return engine::apply_chat_template({{"user", task + prose + question}}, true);
  };
  const size_t fixed = tokenizer.encode(wrap(sentence + "\n\n")).size();
  std::vector<size_t> lengths;
  size_t total = 0;
  // Paragraph k of the excerpt is paras[(first + k) % size]: each paragraph at most once.
  auto para = [&](size_t k) -> const std::string& { return paras[(first + k) % paras.size()]; };
  for (size_t k = 0; k < paras.size(); ++k) {
    const std::string& p = para(k);
    // +1: inside the prose the blank line before the next paragraph is two tokens ("\n",
    // "\n"), not the one it is when the paragraph is encoded alone.
    const size_t len = tokenizer.encode(p + "\n\n", false).size() + 1;
    if (fixed + total + len > target && !lengths.empty()) break;
    lengths.push_back(len);
    total += len;
  }
  // Insert before paragraph `at`: the boundary whose token offset is nearest depth.
  const long long want = std::llround(depth * double(total));
  size_t at = 0;
  long long best = -1;
  for (size_t i = 0, offset = 0; i <= lengths.size(); ++i) {
    const long long gap = std::llabs((long long)offset - want);
    if (best < 0 || gap < best) best = gap, at = i;
    if (i < lengths.size()) offset += lengths[i];
  }
  std::string prose;
  for (size_t i = 0; i <= lengths.size(); ++i) {
    if (i == at) prose += sentence + "\n\n";
    if (i < lengths.size()) prose += para(i) + "\n\n";
  }
  while (!prose.empty() && prose.back() == '\n') prose.pop_back();
  const std::string whole = wrap(prose);
  if (question_at == nullptr) return tokenizer.encode(whole);
  const size_t split = whole.rfind(question);
  std::vector<int32_t> tokens = tokenizer.encode(whole.substr(0, split));
  *question_at = uint32_t(tokens.size());
  const std::vector<int32_t> rest = tokenizer.encode(whole.substr(split));
  tokens.insert(tokens.end(), rest.begin(), rest.end());
  return tokens;
}

std::vector<int32_t> passkey_prompt(const engine::Tokenizer& tokenizer, uint32_t target,
                                    double depth, std::string* expect) {
  const std::string key = kPasskey;
  if (expect) *expect = key;
  return filler_prompt(tokenizer, target,
                       {{"The pass key is " + key + ". Remember it. " + key +
                             " is the pass key. ", depth}},
                       "\nWhat is the pass key? The pass key is");
}

std::vector<std::string> retrieval_task_names() {
  return {"passkey", "passkey-word", "multikey", "needle", "needle2", "kinds", "kinds-after"};
}

std::vector<uint32_t> retrieval_contexts(const Bench& bench, uint32_t answer_tokens,
                                         const std::string& task,
                                         const std::vector<uint32_t>& quick,
                                         const std::vector<uint32_t>& full) {
  std::vector<uint32_t> contexts = bench.full ? full : quick;
  if (!bench.contexts.empty()) contexts = bench.contexts;
  const uint64_t cap = bench.n_ctx > answer_tokens + 16 ? bench.n_ctx - answer_tokens - 16 : 0;
  for (uint32_t& c : contexts) {
    const uint32_t capped = uint32_t(std::min<uint64_t>(c, cap));
    if (capped != c) {
      std::printf("(%s: %u-token context capped at %u: the model's trained context is %llu "
                  "tokens%s)\n", task.c_str(), c, capped, (unsigned long long)bench.n_ctx,
                  bench.n_ctx_from_gguf ? ", from the GGUF metadata" : ", assumed");
    }
    c = capped;
  }
  return contexts;
}

bool answer_has_key(const std::string& answer, const Prompt& prompt) {
  const std::string a = lower(answer);
  if (!prompt.word_key) return a.find(prompt.expect) != std::string::npos;
  std::string joined;
  for (const char c : a) {
    const bool sep = c == '-' || std::isspace(static_cast<unsigned char>(c));
    if (!sep) joined += c;
    else if (joined.empty() || joined.back() != '-') joined += '-';
  }
  return joined.find(prompt.expect) != std::string::npos;
}

std::vector<int32_t> stop_tokens(const engine::Tokenizer& tokenizer) {
  std::vector<int32_t> out;
  for (const int32_t id : {tokenizer.find("<|im_end|>"), tokenizer.find("<|endoftext|>"),
                           tokenizer.eos()})
    if (id >= 0 && std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
  return out;
}

bool build_retrieval_task(const Bench& bench, const std::string& name, RetrievalTask* out,
                          std::string* err) {
  if (name == "kinds" || name == "kinds-after")
    return build_kinds_task(bench, name == "kinds-after", out, err);
  const engine::Tokenizer& tok = *bench.tokenizer;
  out->name = name;
  out->prompts.clear();
  out->contexts.clear();
  const bool needle = name == "needle" || name == "needle2";
  out->answer_tokens = needle ? 16 : 8;
  out->stream_rows = name == "passkey";
  std::vector<std::string> paras;
  const Needle* n = name == "needle" ? &kJargonNeedle : &kPolicyNeedle;
  if (name == "passkey") {
    out->description = std::string("a 5-digit key (") + kPasskey + ") in synthetic filler";
  } else if (name == "passkey-word") {
    out->description = std::string("a word key (") + kPassword + ") in synthetic filler";
  } else if (name == "multikey") {
    out->description = "three labelled 5-digit keys at depths d, d+1/3, d+2/3 (mod 1) in "
                       "filler; the one at depth d is asked for (label cycling by depth)";
  } else if (needle) {
    std::string text;
    if (!read_text(name == "needle" ? bench.text_path : bench.text2_path, &text, err))
      return false;
    paras = paragraphs(text);
    out->description = std::string("\"") + n->needle + "\" in " + n->text_name +
                       ", asked for in a chat prompt";
  } else {
    *err = "unknown retrieval task '" + name + "'";
    return false;
  }
  const std::vector<Grid> g = grid(bench, out->answer_tokens, name);
  for (size_t c = 0; c < g.size(); ++c) {
    out->contexts.push_back(g[c].context);
    for (size_t di = 0; di < g[c].depths.size(); ++di) {
      const double d = g[c].depths[di];
      Prompt p;
      p.id = prompt_id(name, g[c].context, d);
      p.context = c;
      p.depth = d;
      if (name == "passkey") {
        p.tokens = passkey_prompt(tok, g[c].context, d, &p.expect);
      } else if (name == "passkey-word") {
        const std::string key = kPassword;
        p.tokens = filler_prompt(tok, g[c].context,
                                 {{"The pass word is " + key + ". Remember it. " + key +
                                       " is the pass word. ", d}},
                                 "\nWhat is the pass word? The pass word is");
        p.expect = key;
      } else if (name == "multikey") {
        std::vector<Inserted> keys;
        const size_t asked = di % 3;
        for (size_t k = 0; k < 3; ++k) {
          const ColourKey& ck = kColourKeys[(asked + k) % 3];
          const double at = std::fmod(d + double(k) / 3.0, 1.0);
          keys.push_back({std::string("The ") + ck.colour + " pass key is " + ck.key +
                              ". Remember it. " + ck.key + " is the " + ck.colour +
                              " pass key. ", at});
        }
        const std::string colour = kColourKeys[asked].colour;
        p.tokens = filler_prompt(tok, g[c].context, keys,
                                 "\nWhat is the " + colour + " pass key? The " + colour +
                                     " pass key is");
        p.expect = kColourKeys[asked].key;
      } else {
        p.tokens = prose_prompt(tok, paras, 0, n->text_name, n->needle, n->question,
                                g[c].context, d);
        p.expect = n->answer;
      }
      out->prompts.push_back(std::move(p));
    }
  }
  return true;
}

bool stream_ppl_tokens(const Bench& bench, std::vector<int32_t>* tokens, std::string* err) {
  std::string text;
  if (!read_text(bench.text_path, &text, err)) return false;
  const std::vector<int32_t> all = bench.tokenizer->encode(text, false);
  const size_t want = (bench.full ? 4096 : 1024) + 1;  // scored tokens + 1
  if (all.size() < want) {
    *err = bench.text_path + " has " + std::to_string(all.size()) + " tokens; the perplexity "
           "part needs " + std::to_string(want);
    return false;
  }
  tokens->assign(all.begin(), all.begin() + long(want));
  return true;
}

bool build_prefix_ppl(const Bench& bench, std::vector<PplPrompt>* out, std::string* err) {
  std::string text;
  if (!read_text(bench.text_path, &text, err)) return false;
  const std::vector<int32_t> all = bench.tokenizer->encode(text, false);
  // Quick: two 1K prefixes; full: 1K/2K/4K prefixes at two places in the text. Each scores
  // the 512 tokens after its prefix.
  constexpr uint32_t kScored = 512;
  std::vector<uint32_t> prefixes = bench.full ? std::vector<uint32_t>{1024, 2048, 4096}
                                              : std::vector<uint32_t>{1024};
  if (!bench.contexts.empty()) prefixes = bench.contexts;
  std::vector<size_t> offsets = {0, 6144};
  if (!bench.offsets.empty()) offsets.assign(bench.offsets.begin(), bench.offsets.end());
  // Prompts of another --text than the default get its name in their ids, so that runs
  // on several texts can be read side by side (bench/anchors/report.py pairs by id).
  const std::string stem = std::filesystem::path(bench.text_path).stem().string();
  const std::string text_tag = stem == kDefaultText ? "" : stem + "/";
  out->clear();
  for (const uint32_t p : prefixes) {
    for (const size_t off : offsets) {
      if (off + p + kScored > all.size()) {
        *err = bench.text_path + " has " + std::to_string(all.size()) + " tokens; a " +
               std::to_string(p) + "-token prefix at " + std::to_string(off) + " needs " +
               std::to_string(off + p + kScored);
        return false;
      }
      PplPrompt q;
      q.id = "ppl-prefix/" + text_tag + std::to_string(p) + "@" + std::to_string(off);
      q.tokens.assign(all.begin() + long(off), all.begin() + long(off + p + kScored));
      q.prefix = p;
      q.score_from = p + 1;
      out->push_back(std::move(q));
    }
  }
  return true;
}

namespace {

std::string ids_json(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  return s + "]";
}

}  // namespace

bool export_tasks(const Bench& bench, const std::vector<std::string>& tasks, bool perplexity,
                  const std::string& path, std::string* err) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    *err = "--export: cannot write " + path;
    return false;
  }
  const std::string stops = ids_json(stop_tokens(*bench.tokenizer));
  size_t n = 0;
  bool ok = true;
  for (const std::string& name : tasks) {
    RetrievalTask task;
    if (!build_retrieval_task(bench, name, &task, err)) {
      ok = false;
      break;
    }
    for (const Prompt& p : task.prompts) {
      char head[256];
      std::snprintf(head, sizeof head,
                    "{\"kind\":\"retrieval\",\"task\":%s,\"id\":%s,\"context\":%u,"
                    "\"depth\":%.2f,\"expect\":%s,\"answer_tokens\":%u,\"observe_tokens\":%u,",
                    json_string(name).c_str(), json_string(p.id).c_str(),
                    task.contexts[p.context], p.depth, json_string(p.expect).c_str(),
                    task.answer_tokens, engine::Engine::kObserveTokens);
      // "match":"words": the anchors accept the key's words separated by hyphens or
      // blanks, as answer_has_key does.
      // "question_at": where the question starts when it is read after the context.
      const std::string question_at =
          p.question_at ? "\"question_at\":" + std::to_string(p.question_at) + "," : "";
      std::fprintf(f, "%s%s%s\"stop\":%s,\"tokens\":%s}\n", head,
                   p.word_key ? "\"match\":\"words\"," : "", question_at.c_str(), stops.c_str(),
                   ids_json(p.tokens).c_str());
      ++n;
    }
  }
  if (ok && perplexity) {
    std::vector<PplPrompt> prefix;
    std::vector<int32_t> stream;
    ok = build_prefix_ppl(bench, &prefix, err) && stream_ppl_tokens(bench, &stream, err);
    if (ok) {
      for (const PplPrompt& p : prefix) {
        std::fprintf(f, "{\"kind\":\"perplexity\",\"task\":\"ppl-prefix\",\"id\":%s,"
                        "\"prefix\":%u,\"score_from\":%u,\"observe_tokens\":%u,\"tokens\":%s}\n",
                     json_string(p.id).c_str(), p.prefix, p.score_from,
                     engine::Engine::kObserveTokens, ids_json(p.tokens).c_str());
        ++n;
      }
      std::fprintf(f, "{\"kind\":\"perplexity\",\"task\":\"ppl-stream\",\"id\":\"ppl-stream/%zu\","
                      "\"prefix\":0,\"score_from\":1,\"tokens\":%s}\n",
                   stream.size() - 1, ids_json(stream).c_str());
      ++n;
    }
  }
  ok = std::fclose(f) == 0 && ok;
  if (ok) std::printf("export: %zu prompts as token ids to %s\n", n, path.c_str());
  else if (err->empty()) *err = "--export: writing " + path + " failed";
  return ok;
}

}  // namespace quality
