#!/usr/bin/env bash
# The CONNECT peek's cost on a blind tunnel (bench/tunnel_peek.py): first-byte latency through
# this build's proxy, next to a direct connection and, when BENCH_OLD_BIN names one, another
# build (one from before the peek, say). On demand; not part of the test suite.
#
#   bench/peek.sh                                   # this build (release), 500 rounds
#   BENCH_OLD_BIN=/tmp/idemproxy-old BENCH_N=1000 bench/peek.sh
#
# Only loopback traffic; the proxies and servers it starts stop with it.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${BENCH_N:-500}
NEW=${BENCH_BIN:-}
if [ -z "$NEW" ]; then
  cargo build --release --locked --quiet --bin idemproxy
  NEW=target/release/idemproxy
fi
bins=("$NEW")
if [ -n "${BENCH_OLD_BIN:-}" ]; then bins=("$BENCH_OLD_BIN" "$NEW" "$BENCH_OLD_BIN" "$NEW"); fi
exec python3 bench/tunnel_peek.py "$N" "${bins[@]}"
