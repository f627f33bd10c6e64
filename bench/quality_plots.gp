# Plots of kvgc-bench-quality's data files (the benchmark runs this itself when gnuplot is
# installed; bench/anchors/report.py runs it over the merged kvgc + anchors data). By hand:
#   gnuplot -e "prefix='docs/quality/full'; mode='full'; parts='passkey needle perplexity'" \
#           bench/quality_plots.gp
# prefix: the data files' path prefix. For each word of `parts`:
#   a retrieval task or ppl-prefix: PREFIX-pareto-PART.dat -> PREFIX-pareto-PART.png, the
#     Pareto plot (x = KV bytes / f16 full cache, y = accuracy or perplexity / full's; one
#     line per configuration, one point per budget);
#   perplexity: PREFIX-ppl-{256,512}.dat -> PREFIX-ppl.png (per-window perplexity);
#   privacy: PREFIX-privacy.dat -> PREFIX-privacy.png (attacker's advantage and passkey
#     accuracy against the noise scale).
if (!exists("prefix")) prefix = "build/tools/quality-out/quick"
if (!exists("mode")) mode = "quick"
if (!exists("parts")) parts = "passkey needle perplexity"

colors = "black #009e73 #56b4e9 #e69f00 #cc79a7 #0072b2 #d55e00 #7f7f7f #f0c400 #8c564b #17becf #bcbd22 #1f77b4 #ff7f0e #2ca02c #d62728 #9467bd #e377c2"
color(i) = word(colors, (i % words(colors)) + 1)

set grid
set style data linespoints

do for [k = 1:words(parts)] {
  part = word(parts, k)
  if (part eq "perplexity") {
    set terminal pngcairo size 1100,460 font "DejaVu Sans,10" noenhanced
    set output prefix."-ppl.png"
    set multiplot layout 1,2 \
        title "Streaming perplexity (".mode." mode): per 256-token window, relative to the full cache"
    set xlabel "position (tokens scored, end of window)"
    set ylabel "perplexity / full cache's"
    set xrange [0:*]
    set autoscale y
    unset logscale x
    set logscale y 2
    do for [b in "256 512"] {
      f = prefix."-ppl-".b.".dat"
      stats f nooutput
      ncol = STATS_columns
      set title "cache bounded to ".b." tokens"
      if (b eq "512") { set key outside right top } else { unset key }
      plot f using 1:($2/$2) title columnheader(2) dt 2 lw 2 lc rgb "black", \
           for [i=3:ncol] f using 1:(column(i)/$2) title columnheader(i) lw 1.5 pt i lc rgb color(i)
    }
    unset multiplot
    unset output
    unset logscale y
  } else { if (part eq "privacy") {
    set terminal pngcairo size 700,420 font "DejaVu Sans,10" noenhanced
    set output prefix."-privacy.png"
    set title "Score noise: memory (passkey accuracy) vs privacy (attacker's advantage)"
    set xlabel "Laplace noise scale on ranking scores (0 plotted at 0.003)"
    set ylabel "advantage (TPR - FPR) / accuracy"
    set logscale x
    set xrange [0.002:20]
    set yrange [-0.05:1.05]
    set key outside right top
    f = prefix."-privacy.dat"
    plot f using ($1 > 0 ? $1 : 0.003):2 title "attacker's advantage" lw 2 pt 7 lc rgb "#d55e00", \
         f using ($1 > 0 ? $1 : 0.003):3 title "passkey accuracy" lw 2 pt 5 lc rgb "#0072b2"
    unset output
    unset logscale x
    unset xrange
    unset yrange
  } else {
    f = prefix."-pareto-".part.".dat"
    if (system("test -f '".f."' && echo y") eq "y") {
      stats f nooutput
      nb = STATS_blocks
      set terminal pngcairo size 1000,520 font "DejaVu Sans,10" noenhanced
      set output prefix."-pareto-".part.".png"
      is_ppl = strstrt(part, "ppl") > 0
      set title part." (".mode." mode): quality vs KV bytes"
      set xlabel "KV bytes / f16 full cache (log scale)"
      set logscale x
      set xrange [0.015:3]  # from 2.5% of the bytes (issue 23's budgets)
      set xtics (0.025, 0.05, 0.1, 0.125, 0.2, 0.3, 0.5, 1, 2)
      if (is_ppl) { set ylabel "perplexity / full cache's (lower is better)"; set autoscale y } \
      else { set ylabel "accuracy"; set yrange [-0.05:1.05] }
      set key outside right top font ",8"
      plot for [i=0:nb-1] f index i using 1:2 title columnheader(1) lw 1.5 pt (i % 13) + 1 \
           lc rgb color(i)
      unset output
      unset logscale x
      unset xrange
      unset yrange
      set xtics autofreq
    }
  } }
}
