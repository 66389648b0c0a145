#!/usr/bin/env bash
# Shared by ci-metrics.sh and ci-consumer.sh (source it, do not run it):
# random loopback port bases for the CI's exporters and Prometheus.
#
# Why not any random port: the kernel hands out its ephemeral range
# (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default) to the
# outgoing connections the jobs themselves make (mpirun's daemons, curl), so
# a fixed pick inside it can be taken by then: a CI run failed once with
# "cannot serve metrics on 127.0.0.1:39408" (2026-12-02). The picks stay
# below that range and skip ports something already listens on; randomness
# keeps parallel CI jobs on one host apart.

# ci_free_port_base LOW HIGH COUNT: prints a base in [LOW, HIGH) with COUNT
# consecutive ports free of listeners and below the ephemeral range.
ci_free_port_base() {
  local low=$1 high=$2 count=$3 ephemeral_low=32768
  if [ -r /proc/sys/net/ipv4/ip_local_port_range ]; then
    read -r ephemeral_low _ </proc/sys/net/ipv4/ip_local_port_range
  fi
  if [ "$high" -gt $((ephemeral_low - count)) ]; then high=$((ephemeral_low - count)); fi
  if [ "$high" -le "$low" ]; then
    echo "ci_free_port_base: no room below the ephemeral range ($ephemeral_low)" >&2
    return 1
  fi
  local attempt base port taken
  for attempt in $(seq 50); do
    base=$((low + RANDOM % (high - low)))
    taken=0
    for port in $(seq "$base" $((base + count - 1))); do
      # A connection that succeeds means a listener holds the port.
      if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then taken=1; break; fi
    done
    if [ "$taken" -eq 0 ]; then echo "$base"; return 0; fi
  done
  echo "ci_free_port_base: no free run of $count ports in [$low, $high)" >&2
  return 1
}
