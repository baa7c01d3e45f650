#!/usr/bin/env bash
# CPU per request as instructions (valgrind's callgrind), which other work on the machine does
# not change: wall-clock rows move by 20 % on a loaded 2-core VM, these by well under 1 %.
# Counts user-space instructions of every thread of the proxy (its embedded SQLite included),
# not the kernel's work for its system calls, and not Redis's.
#
#   bench/callgrind.sh                                         # this tree's release build
#   bench/callgrind.sh before=/tmp/old/idemproxy after=target/release/idemproxy
#   BENCH_ROWS='redis-A redis-B' BENCH_SECS=4 bench/callgrind.sh ...
#   BENCH_ROWS='mcp-json-A mcp-json-B mcp-sse-A mcp-sse-B' bench/callgrind.sh ...
#                                     # MCP tools/call on Redis, answered as JSON or one SSE event
#
# For each build and row: the proxy under callgrind on one CPU, a warm-up, the counters zeroed,
# BENCH_SECS of load at BENCH_CONNS connections, a dump; instructions over answered requests.
# Prints a Markdown table; the raw dumps stay in BENCH_KEEP (if set) for callgrind_annotate.
# Only loopback; everything it starts stops with it.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${BENCH_SECS:-4}
CONNS=${BENCH_CONNS:-4}
ROWS=${BENCH_ROWS:-redis-A redis-B redis-capped-A redis-capped-B sqlite-A sqlite-B}
for tool in valgrind callgrind_control redis-server python3 nginx; do
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || { echo "missing: $tool" >&2; exit 1; }
done
builds=("$@")
if [ ${#builds[@]} = 0 ]; then
  cargo build --release --locked --quiet --bin idemproxy
  builds=("=target/release/idemproxy")
fi
LOADGEN=${BENCH_LOADGEN:-target/release/examples/loadgen}
[ -n "${BENCH_LOADGEN:-}" ] || cargo build --release --locked --quiet --example loadgen
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

WORK=$(mktemp -d /tmp/idemproxy-callgrind.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

P_HTTP=$(free_port); P_REDIS=$(free_port)
# The MCP stand-in's answer to a tools/call (see bench/run.sh).
MCP_RESULT='{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"refund re_3MmlLrLkdIwHu7ix0kLZc9Ps of 2000 usd on ch_3MmlLrLkdIwHu7ix0snN0B15: succeeded"}],"isError":false}}'
mkdir -p "$WORK/nginx"
cat > "$WORK/nginx/nginx.conf" <<NGX
worker_processes 1; daemon off; pid $WORK/nginx/pid; error_log $WORK/nginx/error.log;
events { worker_connections 1024; }
http {
  access_log off; keepalive_requests 1000000; keepalive_timeout 120s;
  client_body_temp_path $WORK/nginx; proxy_temp_path $WORK/nginx;
  server { listen 127.0.0.1:$P_HTTP; location / { default_type application/json;
    return 200 '{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":2000,"captured":true,"currency":"usd","paid":true,"status":"succeeded"}'; }
    location = /mcp-json { default_type application/json; return 200 '$MCP_RESULT'; }
    location = /mcp-sse { default_type text/event-stream; return 200 'event: message\ndata: $MCP_RESULT\n\n'; } }
}
NGX
"$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" & PIDS+=($!)
redis-server --port "$P_REDIS" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync everysec \
  --dir "$WORK" --logfile "$WORK/redis.log" & PIDS+=($!)
wait_port "$P_HTTP"; wait_port "$P_REDIS"

write_config() { # $1 file, $2 store url
  cat > "$1" <<TOML
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
[admin]
token_sha256 = "$(printf %s bench-admin-token | sha256sum | cut -d' ' -f1)"
[store]
url = "$2"
[[routes]]
name = "bench"
prefix = "/bench"
host = "api.bench.test"
upstream = "http://api.bench.test"
connect_to = "127.0.0.1:$P_HTTP"
provider = "stripe"
key_source = "client"
[[routes]]
name = "capped"
prefix = "/capped"
host = "capped.bench.test"
upstream = "http://api.bench.test"
connect_to = "127.0.0.1:$P_HTTP"
provider = "stripe"
key_source = "client"
[routes.spend]
caps_currency = "usd"
per_run = "1000000000.00"
per_tenant = "1000000000.00"
approve_above = "1000000.00"
TOML
}

# An MCP route (Streamable HTTP) in front of the MCP stand-in: every tools/call is claimed as
# the tool and its arguments. Only in the MCP rows' config (builds before MCP refuse it).
mcp_route() {
  cat <<TOML
[[routes]]
name = "mcp"
prefix = "/mcp"
host = "mcp.bench.test"
upstream = "http://mcp.bench.test"
connect_to = "127.0.0.1:$P_HTTP"
protocol = "mcp"
TOML
}
RESULTS="$WORK/results.tsv"; : > "$RESULTS"
run_row() { # $1 label, $2 build, $3 row
  local label=$1 bin=$2 row=$3 store path keys url pid addr out mcp=()
  store=${row%%-*}
  case $row in
    *capped*) path=/capped/v1/charges ;;
    mcp-json-*) path=/mcp/mcp-json; mcp=(--mcp --host mcp.bench.test); store=redis ;;
    mcp-sse-*) path=/mcp/mcp-sse; mcp=(--mcp --host mcp.bench.test); store=redis ;;
    *) path=/bench/v1/charges ;;
  esac
  case $row in *-A) keys=unique ;; *-B) keys=fixed ;; esac
  case $store in
    redis) url="redis://127.0.0.1:$P_REDIS/0" ;;
    sqlite) url="sqlite://$WORK/claims-$RANDOM$RANDOM.db" ;;
  esac
  write_config "$WORK/proxy.toml" "$url"
  [ ${#mcp[@]} = 0 ] || mcp_route >> "$WORK/proxy.toml"
  out="$WORK/cg.$label.$row"
  : > "$WORK/proxy.out"
  taskset -c 1 valgrind --tool=callgrind --collect-atstart=yes --callgrind-out-file="$out.%p" \
    "$bin" serve --config "$WORK/proxy.toml" > "$WORK/proxy.out" 2> "$WORK/proxy.err" & pid=$!; PIDS+=($pid)
  for _ in $(seq 600); do
    addr=$(sed -n 's/^idemproxy listening proxy=\([^ ]*\).*/\1/p' "$WORK/proxy.out")
    [ -n "$addr" ] && break
    sleep 0.1
  done
  [ -n "$addr" ] || { echo "the proxy did not start:" >&2; cat "$WORK/proxy.err" >&2; exit 1; }
  taskset -c 0 "$LOADGEN" --addr "$addr" --path "$path" --keys "$keys" "${mcp[@]}" --connections "$CONNS" --duration 2s --warmup 0s >/dev/null
  callgrind_control -z "$pid" >/dev/null
  local line sent
  line=$(taskset -c 0 "$LOADGEN" --addr "$addr" --path "$path" --keys "$keys" "${mcp[@]}" --connections "$CONNS" --duration "${SECS}s" --warmup 0s)
  callgrind_control -d "$pid" >/dev/null
  sent=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["sent"])' "$line")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  # The dump after the zeroing holds the measured requests only.
  local dump ir
  dump=$(ls -t "$out".*.1 2>/dev/null | head -1 || true)
  [ -n "$dump" ] || dump=$(ls -t "$out".* | grep -v '\.1$' | head -1)
  ir=$(sed -n 's/^summary: \([0-9]*\).*/\1/p; s/^totals: \([0-9]*\).*/\1/p' "$dump" | head -1)
  printf '%s\t%s\t%s\t%s\n' "$label" "$row" "$ir" "$sent" >> "$RESULTS"
  echo "  ${label:-this build} $row: $ir instructions / $sent requests" >&2
  if [ -n "${BENCH_KEEP:-}" ]; then mkdir -p "$BENCH_KEEP"; cp "$dump" "$BENCH_KEEP/callgrind.${label:-build}.$row"; fi
}
for row in $ROWS; do
  for b in "${builds[@]}"; do
    case $b in *=*) label=${b%%=*}; bin=${b#*=} ;; *) label=""; bin=$b ;; esac
    run_row "$label" "$bin" "$row"
  done
done
python3 - "$RESULTS" "$CONNS" "$SECS" <<'PY'
import sys
path, conns, secs = sys.argv[1:]
rows = [l.rstrip("\n").split("\t") for l in open(path)]
print(f"\ncallgrind, {conns} connections, {secs} s per row after a 2 s warm-up, proxy on one CPU: user-space instructions per answered request (all threads)\n")
print("| build | row | instructions/req | requests |")
print("|---|---|---:|---:|")
for label, row, ir, sent in rows:
    print(f"| {label or 'this build'} | {row} | {int(ir)/max(int(sent),1):,.0f} | {sent} |")
PY
