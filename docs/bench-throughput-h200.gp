# Drawn by statescan-bench --plot; run `gnuplot bench-throughput-h200.gp` in this directory.
set terminal pngcairo size 960,600 font ',11'
set output 'bench-throughput-h200.png'
set title 'statescan-bench: chunkwise forward, bf16, B=1 H=16 D=128, NVIDIA H200' noenhanced
set logscale x 2
set xtics ('8K' 8192, '32K' 32768, '128K' 131072)
set format y '%.0s%c'
set xlabel 'sequence length T (tokens)'
set ylabel 'throughput (tokens/s)'
set xrange [5851.43:183501]
set yrange [0:*]
set grid
set key outside right top noenhanced
plot 'bench-throughput-h200.dat' index 0 using 1:2 with linespoints lw 2 pt 7 lc rgb '#1f77b4' title 'linear', \
    '' index 1 using 1:2 with linespoints lw 2 pt 7 lc rgb '#d62728' title 'retention', \
    '' index 2 using 1:2 with linespoints lw 2 pt 7 lc rgb '#2ca02c' title 'gla', \
    '' index 3 using 1:2 with linespoints lw 2 pt 7 lc rgb '#ff7f0e' title 'deltanet', \
    '' index 4 using 1:2 with linespoints lw 2 pt 7 lc rgb '#9467bd' title 'gated_deltanet', \
    '' index 5 using 1:2 with linespoints lw 2 pt 7 lc rgb '#8c564b' title 'kda'
