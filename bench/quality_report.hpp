// kvgc-bench-quality's tables, data files and RESULT line.
#pragma once

#include <string>
#include <vector>

#include "quality_common.hpp"

namespace quality {

// Tables to stdout; gnuplot data (PREFIX-pareto-TASK.dat: one block per configuration,
// "kv_fraction accuracy" per budget) to bench.prefix.
bool report_retrieval(const Bench& bench, const RetrievalResult& r, std::string* err);
bool report_perplexity(const Bench& bench, const PerplexityResult& r, std::string* err);
bool report_prefix_ppl(const Bench& bench, const PrefixPplResult& r, std::string* err);
bool report_privacy(const Bench& bench, const PrivacyResult& r, std::string* err);

std::string result_line(const std::vector<RetrievalResult>& retrieval, const PerplexityResult& ppl,
                        const PrefixPplResult& prefix, const PrivacyResult& privacy,
                        double seconds);

}  // namespace quality
