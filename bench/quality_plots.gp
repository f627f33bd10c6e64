# Plots of kvgc-bench-quality's data files (the benchmark runs this itself when gnuplot is
# installed). By hand:
#   gnuplot -e "prefix='docs/quality/full'; mode='full'; parts='passkey needle ppl'" \
#           bench/quality_plots.gp
# prefix: the data files' path prefix (--out DIR + "/quick" or "/full"); writes
# PREFIX-passkey.png, PREFIX-needle.png, PREFIX-ppl.png.
if (!exists("prefix")) prefix = "build/tools/quality-out/quick"
if (!exists("mode")) mode = "quick"
if (!exists("parts")) parts = "passkey needle ppl"

# One colour per data column (column 2 is always the full cache: black, dashed).
colors = "black black #009e73 #56b4e9 #e69f00 #cc79a7 #0072b2 #d55e00 #7f7f7f #f0c400"
color(i) = word(colors, i)

set grid
set key outside right top spacing 1.1
set style data linespoints

# Accuracy vs budget, one line per policy. Policies are nudged sideways a little
# (+-1.2 points of budget) so equal results do not hide each other.
nudge(i) = (i - 4.5) * 0.5
if (strstrt(parts, "passkey") > 0) {
  set terminal pngcairo size 980,420 font "DejaVu Sans,10"
  set output prefix."-passkey.png"
  set multiplot layout 1,2 title "Passkey retrieval (".mode." mode): accuracy vs token budget"
  set xlabel "token budget (% of the prompt)"
  set ylabel "accuracy"
  set yrange [-0.05:1.05]
  set xrange [5:55]
  set xtics (10, 20, 50)
  set title "prefill: observe (SnapKV-style, default)"
  unset key
  f = prefix."-passkey-observe.dat"
  plot f using 1:2 title columnheader(2) dt 2 lw 2 lc rgb color(2), \
       for [i=3:7] f using ($1 + nudge(i)):i title columnheader(i) lw 2 pt i lc rgb color(i)
  set title "prefill: stream (evict after every chunk)"
  set key outside right top
  f = prefix."-passkey-stream.dat"
  plot f using 1:2 title columnheader(2) dt 2 lw 2 lc rgb color(2), \
       for [i=3:7] f using ($1 + nudge(i)):i title columnheader(i) lw 2 pt i lc rgb color(i)
  unset multiplot
  unset output
}

if (strstrt(parts, "needle") > 0) {
  set terminal pngcairo size 660,420 font "DejaVu Sans,10"
  set output prefix."-needle.png"
  set title "Needle in the Jargon File (".mode." mode, observe prefill)"
  set xlabel "token budget (% of the prompt)"
  set ylabel "accuracy"
  set yrange [-0.05:1.05]
  set xrange [5:55]
  set xtics (10, 20, 50)
  set key outside right top
  f = prefix."-needle-observe.dat"
  plot f using 1:2 title columnheader(2) dt 2 lw 2 lc rgb color(2), \
       for [i=3:7] f using ($1 + nudge(i)):i title columnheader(i) lw 2 pt i lc rgb color(i)
  unset output
}

# Perplexity per 256-token window relative to the full cache's on the same window, vs
# position, cache bounded to 256 and 512 tokens.
if (strstrt(parts, "ppl") > 0) {
  set terminal pngcairo size 1100,460 font "DejaVu Sans,10"
  set output prefix."-ppl.png"
  set multiplot layout 1,2 \
      title "Streaming perplexity (".mode." mode): per 256-token window, relative to the full cache"
  set xlabel "position (tokens scored, end of window)"
  set ylabel "perplexity / full cache's"
  set xrange [0:*]
  set autoscale y
  xstep = (mode eq "full") ? 1024 : 256
  set xtics 0, xstep
  set logscale y 2
  unset key
  set title "cache bounded to 256 tokens"
  f = prefix."-ppl-256.dat"
  plot f using 1:($2/$2) title columnheader(2) dt 2 lw 2 lc rgb color(2), \
       for [i=3:10] f using 1:(column(i)/$2) title columnheader(i) lw 1.5 pt i lc rgb color(i)
  set title "cache bounded to 512 tokens"
  set key outside right top
  f = prefix."-ppl-512.dat"
  plot f using 1:($2/$2) title columnheader(2) dt 2 lw 2 lc rgb color(2), \
       for [i=3:10] f using 1:(column(i)/$2) title columnheader(i) lw 1.5 pt i lc rgb color(i)
  unset multiplot
  unset output
}
