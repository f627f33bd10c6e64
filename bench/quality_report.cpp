#include "quality_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace quality {
namespace {

std::string fmt(const char* format, double a, double b = 0) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, a, b);
  return buf;
}

// One block per row: a title line, then "kv_fraction value" per budget (gnuplot: index i,
// title columnheader(1)).
std::string pareto_blocks(const std::vector<std::string>& rows,
                          const std::vector<std::vector<double>>& x,
                          const std::vector<std::vector<double>>& y) {
  std::string data;
  for (size_t p = 0; p < rows.size(); ++p) {
    data += "\"kvgc " + rows[p] + "\" value\n";
    const size_t n = p == 0 ? 1 : x[p].size();  // full: one point
    for (size_t f = 0; f < n; ++f) data += fmt("%.5f %.5f\n", x[p][f], y[p][f]);
    data += "\n\n";
  }
  return data;
}

// The 95% Wilson score interval of correct/total, in percent: small samples (20 prompts a
// cell) and rates near 0 or 1, where the normal approximation fails.
std::string wilson_95(int correct, int total) {
  if (total <= 0) return "-";
  const double z = 1.959964, n = total, p = correct / n;
  const double mid = (p + z * z / (2 * n)) / (1 + z * z / n);
  const double half = z * std::sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n);
  return fmt("%.0f-%.0f%%", 100 * std::max(0.0, mid - half), 100 * std::min(1.0, mid + half));
}

void add(Cell* a, const Cell& b) {
  a->correct += b.correct;
  a->total += b.total;
  a->kept += b.kept;
  a->kv_fraction_sum += b.kv_fraction_sum;
}

// One cell of the per-cell tables: "k/n lo-hi%", and for a bounded row "kept k/K": of the
// full cache's K correct answers, the k this row gave too (the issue's "kept of full's").
std::string cell_text(const Cell& c, const Cell* full) {
  std::string s = std::to_string(c.correct) + "/" + std::to_string(c.total) + " " +
                  wilson_95(c.correct, c.total);
  if (full) s += " kept " + std::to_string(c.kept) + "/" + std::to_string(full->correct);
  return s;
}

// Tasks with cells (kinds): per configuration, one row per cell and length, then the same
// summed over texts (per format), over formats (per text) and over all cells.
void report_cells(const RetrievalResult& r) {
  const size_t m = 0;  // the observe prefill; cell tasks have no stream rows
  struct Row {
    std::string name;
    std::vector<size_t> cells;
  };
  std::vector<Row> rows;
  std::vector<std::string> texts, formats;
  for (size_t i = 0; i < r.cell_names.size(); ++i) {
    const std::string& n = r.cell_names[i];
    rows.push_back({n, {i}});
    const std::string text = n.substr(0, n.find('/')), format = n.substr(n.find('/') + 1);
    if (std::find(texts.begin(), texts.end(), text) == texts.end()) texts.push_back(text);
    if (std::find(formats.begin(), formats.end(), format) == formats.end()) formats.push_back(format);
  }
  auto group = [&](const std::string& name, auto&& pick) {
    Row row{name, {}};
    for (size_t i = 0; i < r.cell_names.size(); ++i)
      if (pick(r.cell_names[i])) row.cells.push_back(i);
    rows.push_back(row);
  };
  for (const std::string& f : formats)
    group("all texts/" + f, [&](const std::string& n) { return n.substr(n.find('/') + 1) == f; });
  for (const std::string& t : texts)
    group(t + "/all formats", [&](const std::string& n) { return n.substr(0, n.find('/')) == t; });
  group("all", [](const std::string&) { return true; });

  for (size_t p = 1; p < r.policies.size(); ++p) {
    std::printf("%s by cell, %s [%s]: correct/total, its 95%% (Wilson) interval, and kept: of "
                "the full cache's correct answers, how many this configuration gave too\n",
                r.task.c_str(), r.policies[p].c_str(), r.budget_kinds[p].c_str());
    std::printf("%-36s  %-24s", "cell @ tokens", "full");
    for (const double f : r.fractions) std::printf("  %-28s", fmt("%g%%", 100.0 * f).c_str());
    std::printf("\n");
    for (size_t c = 0; c < r.contexts.size(); ++c) {
      for (const Row& row : rows) {
        Cell full;
        std::vector<Cell> bounded(r.fractions.size());
        for (const size_t i : row.cells) {
          add(&full, r.by_cell[i][c][m][0][0]);
          for (size_t f = 0; f < r.fractions.size(); ++f) add(&bounded[f], r.by_cell[i][c][m][p][f]);
        }
        std::printf("%-36s  %-24s", (row.name + " @" + std::to_string(r.contexts[c])).c_str(),
                    cell_text(full, nullptr).c_str());
        for (const Cell& b : bounded) std::printf("  %-28s", cell_text(b, &full).c_str());
        std::printf("\n");
      }
    }
    std::printf("\n");
  }
}

}  // namespace

bool report_retrieval(const Bench& bench, const RetrievalResult& r, std::string* err) {
  for (size_t m = 0; m < r.modes.size(); ++m) {
    std::printf("%s, prefill %s%s: correct/total, its 95%% (Wilson) interval, and KV bytes held "
                "after the prefill as %% of an f16 full cache of the prompt\n", r.task.c_str(), r.modes[m].c_str(),
                m == 0 ? " (shared prefill, replayed per configuration)" : " (one per configuration)");
    std::printf("%-36s", "configuration \\ budget");
    for (const double f : r.fractions) std::printf("  %22.1f%%", 100.0 * f);
    std::printf("\n");
    for (size_t p = 0; p < r.policies.size(); ++p) {
      std::printf("%-36s", (r.policies[p] + (p ? " [" + r.budget_kinds[p] + "]" : "")).c_str());
      for (size_t f = 0; f < r.fractions.size(); ++f) {
        const Cell& cell = r.cells[m][p][f];
        char buf[32];
        std::snprintf(buf, sizeof buf, "%d/%d", cell.correct, cell.total);
        std::printf("  %7s %8s %5.1f%%", buf, wilson_95(cell.correct, cell.total).c_str(),
                    100.0 * cell.kv_fraction());
        if (p == 0) break;  // full: one column
      }
      std::printf("\n");
    }
    if (r.contexts.size() > 1) {
      std::printf("by context (correct/total at each budget):\n%-36s", "");
      for (const uint32_t c : r.contexts) {
        std::string head = fmt("~%.0f:", double(c));
        for (const double f : r.fractions) head += fmt(" %.0f%%", 100.0 * f);
        std::printf("  %-20s", head.c_str());
      }
      std::printf("\n");
      for (size_t p = 0; p < r.policies.size(); ++p) {
        std::printf("%-36s", r.policies[p].c_str());
        for (size_t c = 0; c < r.contexts.size(); ++c) {
          std::string cells;
          for (const Cell& cell : r.by_context[c][m][p]) {
            if (!cells.empty()) cells += ' ';
            cells += fmt("%.0f/%.0f", cell.correct, cell.total);
          }
          std::printf("  %-20s", cells.c_str());
        }
        std::printf("\n");
      }
    }
    if (m == 0 && !r.cell_names.empty()) report_cells(r);
    if (m == 0 && r.replays_checked > 0) {
      std::printf("replay check: %zu replays against a fresh prefill each: %zu caches differ, "
                  "%zu answers differ\n", r.replays_checked, r.replay_mismatches,
                  r.answer_mismatches);
    }
    std::printf("\n");
    std::vector<std::vector<double>> x(r.policies.size()), y(r.policies.size());
    for (size_t p = 0; p < r.policies.size(); ++p)
      for (const Cell& cell : r.cells[m][p]) {
        x[p].push_back(cell.kv_fraction());
        y[p].push_back(cell.accuracy());
      }
    const std::string suffix = m == 0 ? "" : "-" + r.modes[m];
    if (!write_text(bench.prefix + "-pareto-" + r.task + suffix + ".dat",
                    pareto_blocks(r.policies, x, y), err))
      return false;
  }
  std::printf("(%.0f s)\n\n", r.seconds);
  return true;
}

bool report_perplexity(const Bench& bench, const PerplexityResult& r, std::string* err) {
  (void)bench, (void)err;
  std::printf("(streaming perplexity: %.0f s)\n\n", r.seconds);
  return true;
}

bool report_prefix_ppl(const Bench& bench, const PrefixPplResult& r, std::string* err) {
  std::printf("prefix perplexity over %zu prefixes (%zu scored tokens): perplexity / full "
              "cache's, and KV bytes held after the prefill as %% of an f16 full cache\n",
              r.prefixes, r.scored_tokens);
  std::printf("%-36s", "configuration \\ budget");
  for (const double f : r.fractions) std::printf("  %14.1f%%", 100.0 * f);
  std::printf("\n");
  const double base = r.perplexity[0][0];
  std::vector<std::vector<double>> y = r.perplexity;
  for (size_t p = 0; p < r.policies.size(); ++p) {
    std::printf("%-36s", (r.policies[p] + (p ? " [" + r.budget_kinds[p] + "]" : "")).c_str());
    for (size_t f = 0; f < r.fractions.size(); ++f) {
      y[p][f] = r.perplexity[p][f] / base;
      std::printf("  %7.3fx %5.1f%%", y[p][f], 100.0 * r.kv_fraction[p][f]);
      if (p == 0) break;
    }
    std::printf("\n");
  }
  std::printf("(full cache: perplexity %.3f; %.0f s)\n\n", base, r.seconds);
  return write_text(bench.prefix + "-pareto-ppl-prefix.dat",
                    pareto_blocks(r.policies, r.kv_fraction, y), err);
}

bool report_privacy(const Bench& bench, const PrivacyResult& r, std::string* err) {
  std::printf("score noise vs a cache-timing attacker (%s, %.0f%% budget): the attacker's "
              "advantage (TPR - FPR of \"cached => heavy hitter\", 0 = guessing) and passkey "
              "accuracy\n", r.config.c_str(), 100 * r.fraction);
  std::printf("%10s  %10s  %10s\n", "noise", "advantage", "passkey");
  std::string data = "noise advantage accuracy\n";
  for (const PrivacyRow& row : r.rows) {
    std::printf("%10g  %10.3f  %5d/%-4d\n", row.noise, row.advantage, row.correct, row.total);
    data += fmt("%g ", row.noise) + fmt("%.5f ", row.advantage) + fmt("%.5f\n", row.accuracy);
  }
  std::printf("(%.0f s)\n\n", r.seconds);
  return write_text(bench.prefix + "-privacy.dat", data, err);
}

std::string result_line(const std::vector<RetrievalResult>& retrieval, const PerplexityResult& ppl,
                        const PrefixPplResult& prefix, const PrivacyResult& privacy,
                        double seconds) {
  std::string ratios = "RESULT", raw;
  auto pct = [](double f) { return fmt("%g", std::round(1000 * f) / 10); };
  for (const RetrievalResult& r : retrieval) {
    const std::string task = key_name(r.task);
    for (size_t m = 0; m < r.modes.size(); ++m) {
      const std::string mode = m == 0 ? "" : "_" + r.modes[m];
      const Cell& full = r.cells[0][0][0];
      if (m == 0) raw += " " + task + "_full=" + std::to_string(full.correct) + "/" + std::to_string(full.total);
      for (size_t p = 1; p < r.policies.size(); ++p) {
        for (size_t f = 0; f < r.fractions.size(); ++f) {
          const Cell& c = r.cells[m][p][f];
          const std::string key = task + mode + "_" + key_name(r.policies[p]) + "_" + pct(r.fractions[f]);
          ratios += " " + key + "_vs_full=" + fmt("%.2f", full.accuracy() > 0 ? c.accuracy() / full.accuracy() : 0.0);
          raw += " " + key + "=" + std::to_string(c.correct) + "/" + std::to_string(c.total) +
                 " " + key + "_kv=" + fmt("%.3f", c.kv_fraction());
        }
      }
    }
    // Cell tasks: the share of the full cache's correct answers each row kept (a ratio),
    // then every cell's counts over all lengths.
    if (!r.cell_names.empty()) {
      const Cell& full = r.cells[0][0][0];
      for (size_t p = 1; p < r.policies.size(); ++p)
        for (size_t f = 0; f < r.fractions.size(); ++f)
          ratios += " " + task + "_" + key_name(r.policies[p]) + "_" + pct(r.fractions[f]) +
                    "_kept=" + fmt("%.2f", full.correct ? double(r.cells[0][p][f].kept) / full.correct : 0.0);
      for (size_t i = 0; i < r.cell_names.size(); ++i) {
        std::vector<std::vector<Cell>> sum(r.policies.size(), std::vector<Cell>(r.fractions.size()));
        for (const CellTable& t : r.by_cell[i])
          for (size_t p = 0; p < r.policies.size(); ++p)
            for (size_t f = 0; f < r.fractions.size(); ++f) add(&sum[p][f], t[0][p][f]);
        const std::string cell = task + "_" + key_name(r.cell_names[i]);
        raw += " " + cell + "_full=" + std::to_string(sum[0][0].correct) + "/" + std::to_string(sum[0][0].total);
        for (size_t p = 1; p < r.policies.size(); ++p)
          for (size_t f = 0; f < r.fractions.size(); ++f) {
            const std::string key = cell + "_" + key_name(r.policies[p]) + "_" + pct(r.fractions[f]);
            raw += " " + key + "=" + std::to_string(sum[p][f].correct) + "/" +
                   std::to_string(sum[p][f].total) + " " + key + "_kept=" +
                   std::to_string(sum[p][f].kept) + "/" + std::to_string(sum[0][0].correct);
          }
      }
    }
    raw += " " + task + "_seconds=" + fmt("%.0f", r.seconds);
  }
  if (!prefix.perplexity.empty()) {
    const double base = prefix.perplexity[0][0];
    for (size_t p = 1; p < prefix.policies.size(); ++p)
      for (size_t f = 0; f < prefix.fractions.size(); ++f) {
        const std::string key = "pplprefix_" + key_name(prefix.policies[p]) + "_" + pct(prefix.fractions[f]);
        ratios += " " + key + "_vs_full=" + fmt("%.3f", prefix.perplexity[p][f] / base);
        raw += " " + key + "_kv=" + fmt("%.3f", prefix.kv_fraction[p][f]);
      }
    raw += " pplprefix_full=" + fmt("%.3f", base) + " pplprefix_seconds=" + fmt("%.0f", prefix.seconds);
  }
  if (ppl.full.perplexity > 0) {
    for (size_t b = 0; b < ppl.bounded.size(); ++b)
      for (const PerplexityRow& row : ppl.bounded[b]) {
        const std::string key = "ppl" + std::to_string(ppl.cache_tokens[b]) + "_" + key_name(row.name);
        ratios += " " + key + "_vs_full=" + fmt("%.3f", row.perplexity / ppl.full.perplexity);
        raw += " " + key + "=" + fmt("%.3f", row.perplexity) + " " + key + "_kv=" + fmt("%.3f", row.held.fraction());
      }
    raw += " ppl_full=" + fmt("%.3f", ppl.full.perplexity) + " ppl_tokens=" +
           std::to_string(ppl.scored_tokens) + " ppl_seconds=" + fmt("%.0f", ppl.seconds);
  }
  for (const PrivacyRow& row : privacy.rows) {
    const std::string key = "privacy_noise" + key_name(fmt("%g", row.noise));
    ratios += " " + key + "_advantage=" + fmt("%.3f", row.advantage) + " " + key +
              "_passkey=" + fmt("%.2f", row.accuracy);
  }
  return ratios + raw + " seconds=" + fmt("%.0f", seconds);
}

}  // namespace quality
