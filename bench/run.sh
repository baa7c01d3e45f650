#!/usr/bin/env bash
# The benchmark: idemproxy next to a direct call and nginx as a plain reverse proxy, in ONE run
# on this machine, against the same fake provider (nginx answering ~300 bytes of JSON to
# POST /v1/charges). Prints a Markdown table of medians over repetitions.
#
#   bench/run.sh                      # defaults: 32 connections, 3 reps x 10 s per scenario
#   BENCH_SECS=5 BENCH_REPS=1 bench/run.sh
#   BENCH_SYSCALLS=1 BENCH_ONLY="1 connection" bench/run.sh   # + system calls and context switches per request (perf)
#   BENCH_SYSCALLS=detail BENCH_TRACE_DIR=/tmp/tr bench/run.sh  # + each thread's calls by name per row (perf trace -s)
#   BENCH_ONLY='postgres|redis-tls' bench/run.sh   # the store rows beside the baselines
#   BENCH_ONLY='gateway|redis: A new' bench/run.sh # the nginx + Lua + Redis gateway (bench/gateway.lua)
#   BENCH_ONLY='redis: A' BENCH_BIN=/tmp/idemproxy-old bench/run.sh
#                                     # the baselines plus the rows matching a regex, with
#                                     # another build
#   BENCH_BINS='before=/tmp/old/idemproxy after=target/release/idemproxy' BENCH_ONLY='redis: (A new|B)' bench/run.sh
#                                     # two (or more) builds side by side in ONE run: each
#                                     # repetition runs every build in turn (before, after,
#                                     # before, after, ...) against the same provider and stores;
#                                     # rows are named idemproxy[label]
#
# Only loopback traffic; every process it starts is stopped on exit. Installs nginx-light if
# missing (Debian). Pinning on 2 cores: load generator + provider on CPU 0, the proxy under test
# (idemproxy or nginx) + its store on CPU 1.
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${BENCH_SECS:-10}
REPS=${BENCH_REPS:-3}
CONNS=${BENCH_CONNS:-32}
WARMUP=${BENCH_WARMUP:-2}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  echo "installing nginx-light" >&2
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
  as_root pkill -x nginx || true   # the package may start its own instance on :80
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
if ! command -v pgrep >/dev/null 2>&1; then
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq procps >/dev/null
fi
for tool in redis-server redis-benchmark openssl python3 taskset pgrep; do
  command -v "$tool" >/dev/null || { echo "missing: $tool" >&2; exit 1; }
done

# BENCH_LOADGEN names a load generator already built: nothing is built then.
LOADGEN=${BENCH_LOADGEN:-target/release/examples/loadgen}
if [ -z "${BENCH_LOADGEN:-}" ]; then
  echo "building (release)..." >&2
  cargo build --release --locked --quiet --bin idemproxy --example loadgen --example relay
fi
# The bare CONNECT relay beside the proxy's blind tunnel (built with the load generator).
RELAY=${BENCH_RELAY:-$(dirname "$LOADGEN")/relay}
BIN=${BENCH_BIN:-target/release/idemproxy}
# The builds under test, as label=path (an empty label for the one build of a plain run).
read -r -a BINS <<<"${BENCH_BINS:-=$BIN}"
for b in "${BINS[@]}"; do [ -x "${b#*=}" ] || { echo "not an executable: ${b#*=}" >&2; exit 1; }; done
BIN=${BINS[0]#*=}   # the build that makes the CA
ONLY=${BENCH_ONLY:-.}

WORK=$(mktemp -d /tmp/idemproxy-bench.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

if [ "$(nproc)" -ge 2 ]; then LOAD_CPU=0; PROXY_CPU=1; else LOAD_CPU=0; PROXY_CPU=0; fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

# --- PKI: a bench CA and a leaf for the fake provider's TLS port -----------------------------
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj "/CN=bench CA" \
  -keyout "$WORK/bench-ca.key" -out "$WORK/bench-ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=api.bench.test" \
  -keyout "$WORK/leaf.key" -out "$WORK/leaf.csr" 2>/dev/null
printf 'subjectAltName=DNS:api.bench.test,DNS:secure.bench.test,DNS:localhost\nextendedKeyUsage=serverAuth\n' > "$WORK/leaf.ext"
openssl x509 -req -in "$WORK/leaf.csr" -CA "$WORK/bench-ca.pem" -CAkey "$WORK/bench-ca.key" -CAcreateserial \
  -days 2 -extfile "$WORK/leaf.ext" -out "$WORK/leaf.pem" 2>/dev/null

# --- the fake provider (nginx, CPU 0) and nginx as a plain reverse proxy (CPU 1) --------------
# P_TUNNEL: the same TLS server on a port no route sends to, for the blind tunnel rows (a
# CONNECT to a route's upstream address is refused: it would pass the route by), called
# `localhost`, a name no route covers (the peek splices it rather than intercepting). Where a
# route caps spend, a CONNECT to an address, to a host tls.tunnel_hosts does not list, or whose
# ClientHello names another host is refused: so it is listed, and the SNI is `localhost` too.
P_HTTP=$(free_port); P_TLS=$(free_port); P_NGINX=$(free_port); P_TUNNEL=$(free_port)
BODY='{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":2000,"amount_captured":2000,"balance_transaction":"txn_3MmlLrLkdIwHu7ix0uke3Ezy","captured":true,"created":1679090539,"currency":"usd","livemode":false,"paid":true,"status":"succeeded","outcome":{"network_status":"approved_by_network","risk_level":"normal","type":"authorized"}}'
# The MCP stand-in: the same nginx answering a `tools/call` with its result, as one JSON body
# (/mcp-json) or as one SSE `message` event (/mcp-sse); the load generator's calls all carry
# JSON-RPC id 1, as every new client process's first call does.
MCP_RESULT='{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"refund re_3MmlLrLkdIwHu7ix0kLZc9Ps of 2000 usd on ch_3MmlLrLkdIwHu7ix0snN0B15: succeeded"}],"isError":false}}'
MCP_LOCATIONS="location = /mcp-json { default_type application/json; return 200 '$MCP_RESULT'; }
           location = /mcp-sse { default_type text/event-stream; return 200 'event: message\\ndata: $MCP_RESULT\\n\\n'; }"
mkdir -p "$WORK/nginx-provider" "$WORK/nginx-proxy"
cat > "$WORK/nginx-provider/nginx.conf" <<NGX
worker_processes 1; daemon off; pid $WORK/nginx-provider/pid; error_log $WORK/nginx-provider/error.log;
events { worker_connections 8192; }
http {
  access_log off; keepalive_requests 1000000; keepalive_timeout 120s;
  client_body_temp_path $WORK/nginx-provider; proxy_temp_path $WORK/nginx-provider;
  server { listen 127.0.0.1:$P_HTTP; location / { default_type application/json; return 200 '$BODY'; }
           $MCP_LOCATIONS }
  server { listen 127.0.0.1:$P_TLS ssl; listen 127.0.0.1:$P_TUNNEL ssl; ssl_certificate $WORK/leaf.pem; ssl_certificate_key $WORK/leaf.key;
           location / { default_type application/json; return 200 '$BODY'; } }
}
NGX
cat > "$WORK/nginx-proxy/nginx.conf" <<NGX
worker_processes 1; daemon off; pid $WORK/nginx-proxy/pid; error_log $WORK/nginx-proxy/error.log;
events { worker_connections 8192; }
http {
  access_log off; keepalive_requests 1000000; keepalive_timeout 120s;
  client_body_temp_path $WORK/nginx-proxy; proxy_temp_path $WORK/nginx-proxy;
  upstream provider { server 127.0.0.1:$P_HTTP; keepalive 64; }
  server { listen 127.0.0.1:$P_NGINX;
           location / { proxy_pass http://provider; proxy_http_version 1.1; proxy_set_header Connection ""; } }
}
NGX
taskset -c $LOAD_CPU "$NGINX" -p "$WORK/nginx-provider" -c "$WORK/nginx-provider/nginx.conf" & PIDS+=($!)
taskset -c $PROXY_CPU "$NGINX" -p "$WORK/nginx-proxy" -c "$WORK/nginx-proxy/nginx.conf" & NGINX_PROXY_PID=$!; PIDS+=($!)
wait_port "$P_HTTP"; wait_port "$P_TLS"; wait_port "$P_NGINX"; wait_port "$P_TUNNEL"

# --- Redis (CPU 1), with AOF as production should run it --------------------------------------
P_REDIS=$(free_port)
taskset -c $PROXY_CPU redis-server --port "$P_REDIS" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync everysec \
  --dir "$WORK" --logfile "$WORK/redis.log" & REDIS_PID=$!; PIDS+=($!)
wait_port "$P_REDIS"

# --- Redis over TLS (CPU 1): the same Redis settings, a TLS port only ---------------------------
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=127.0.0.1" \
  -keyout "$WORK/redis.key" -out "$WORK/redis.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > "$WORK/redis.ext"
openssl x509 -req -in "$WORK/redis.csr" -CA "$WORK/bench-ca.pem" -CAkey "$WORK/bench-ca.key" -CAcreateserial \
  -days 2 -extfile "$WORK/redis.ext" -out "$WORK/redis.pem" 2>/dev/null
P_REDIS_TLS=$(free_port)
mkdir -p "$WORK/redis-tls"
taskset -c $PROXY_CPU redis-server --port 0 --tls-port "$P_REDIS_TLS" --tls-cert-file "$WORK/redis.pem" \
  --tls-key-file "$WORK/redis.key" --tls-ca-cert-file "$WORK/bench-ca.pem" --tls-auth-clients no \
  --bind 127.0.0.1 --save "" --appendonly yes --appendfsync everysec \
  --dir "$WORK/redis-tls" --logfile "$WORK/redis-tls.log" & REDIS_TLS_PID=$!; PIDS+=($!)
wait_port "$P_REDIS_TLS"

# --- PostgreSQL (CPU 1): a private cluster, durable defaults (fsync, synchronous_commit on) ------
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
P_PG=""; PG_PID=""
if [ -n "$PG_BIN" ] && [ -x "$PG_BIN/initdb" ]; then
  PG_RUN=(); [ "$(id -u)" = 0 ] && PG_RUN=(setpriv --reuid=postgres --regid=postgres --init-groups)
  mkdir -p "$WORK/pg"; [ "$(id -u)" = 0 ] && chown postgres: "$WORK/pg"
  chmod 755 "$WORK"
  "${PG_RUN[@]}" "$PG_BIN/initdb" -D "$WORK/pg/data" -U postgres -A trust -E UTF8 >/dev/null
  P_PG=$(free_port)
  taskset -c $PROXY_CPU "${PG_RUN[@]}" "$PG_BIN/postgres" -D "$WORK/pg/data" -p "$P_PG" \
    -c listen_addresses=127.0.0.1 -c unix_socket_directories="$WORK/pg" -c shared_buffers=128MB \
    -c max_connections=100 > "$WORK/pg/log" 2>&1 & PG_PID=$!; PIDS+=($!)
  wait_port "$P_PG"
else
  echo "no PostgreSQL server binaries (apt-get install postgresql): postgres rows skipped" >&2
fi

# --- idemproxy configs -------------------------------------------------------------------------
HAVE_TLS=0
if "$BIN" ca init --help >/dev/null 2>&1; then
  "$BIN" ca init --dir "$WORK/ca" >/dev/null && HAVE_TLS=1
fi
write_config() { # $1 file, $2 store url, $3 more [store] lines
  cat > "$1" <<TOML
[server]
listen = "127.0.0.1:0"
# The capped route parks payments above approve_above for approval: a proxy must have an admin
# listener and token for that (never reached here).
admin_listen = "127.0.0.1:0"
[admin]
token_sha256 = "$(printf %s bench-admin-token | sha256sum | cut -d' ' -f1)"
[store]
url = "$2"
${3:-}
$( [ $HAVE_TLS = 1 ] && printf '[tls]\nca_cert = "%s"\nca_key = "%s"\nconnect_ports = [443, %s]\ntunnel_hosts = ["localhost"]\n' "$WORK/ca/ca.pem" "$WORK/ca/ca.key" "$P_TUNNEL" )
$( [ $HAVE_TLS = 1 ] && printf '[egress]\nallow = ["127.0.0.1:%s", "localhost:%s"]  # loopback is refused unless named\n' "$P_TLS" "$P_TUNNEL" )
$( [ -n "${BENCH_EXTRA_TOML:-}" ] && printf '%s\n' "$BENCH_EXTRA_TOML" )
[[routes]]
name = "bench"
prefix = "/bench"
host = "api.bench.test"
upstream = "http://api.bench.test"
connect_to = "127.0.0.1:$P_HTTP"
provider = "stripe"
# The load generator sends one body under many keys: keyed on the client's key, each is a new
# claim (the stripe profile's default, the whole request, would make every row after the first
# request a replay).
key_source = "client"
# The same route with spend control: every request is a payment that is priced, checked
# against a run and a tenant budget (never reached) and reserved before its claim.
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
[[routes]]
name = "secure"
host = "secure.bench.test"
upstream = "https://secure.bench.test"
connect_to = "127.0.0.1:$P_TLS"
upstream_ca = "$WORK/bench-ca.pem"
provider = "stripe"
# As on the bench route: the stripe profile's own key source (the whole request) would make
# every scenario A request after the first a replay of it.
key_source = "client"
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
PROXY_PID=""; PROXY_ADDR=""
start_proxy() { # $1 config, $2 the build (default: the first)
  : > "$WORK/proxy.out"
  taskset -c $PROXY_CPU "${2:-$BIN}" serve --config "$1" > "$WORK/proxy.out" 2> "$WORK/proxy.err" & PROXY_PID=$!; PIDS+=($PROXY_PID)
  for _ in $(seq 200); do
    PROXY_ADDR=$(sed -n 's/^idemproxy listening proxy=\([^ ]*\).*/\1/p' "$WORK/proxy.out")
    [ -n "$PROXY_ADDR" ] && return 0
    sleep 0.05
  done
  echo "idemproxy did not start:" >&2; cat "$WORK/proxy.err" >&2; exit 1
}
stop_proxy() { kill "$PROXY_PID" 2>/dev/null || true; wait "$PROXY_PID" 2>/dev/null || true; }
peak_rss_mib() { awk '/VmHWM/ {printf "%.1f", $2/1024}' "/proc/$1/status" 2>/dev/null || echo "?"; }

# --- measuring ---------------------------------------------------------------------------------
RESULTS="$WORK/results.jsonl"; : > "$RESULTS"
# CPU time (clock ticks) of a process and its threads, plus its reaped children (Redis's AOF
# rewrites run in forked children) and, for nginx, its worker processes.
cpu_ticks() {
  local total=0 p
  for p in "$@"; do
    [ -n "$p" ] || continue
    for q in "$p" $(pgrep -P "$p" 2>/dev/null); do
      # A child (an AOF rewrite) may exit between pgrep and the read: it then counts 0.
      local t
      t=$(awk '{print $14+$15+$16+$17}' "/proc/$q/stat" 2>/dev/null) || t=0
      total=$((total + ${t:-0}))
    done
  done
  echo "$total"
}
HZ=$(getconf CLK_TCK)
# Whose CPU each row charges to the proxy under test and to its store (set before each block).
CPU_PROXY=""; CPU_STORE=""
# Calls per command so far, from a Redis's own `INFO commandstats`, as a JSON object.
redis_calls() { # $1 port, $2 "tls" for the TLS Redis
  local tls=(); [ "${2:-}" = tls ] && tls=(--tls --cacert "$WORK/bench-ca.pem")
  redis-cli -p "$1" "${tls[@]}" INFO commandstats 2>/dev/null | tr -d '\r' |
    awk -F'[:,=]' '/^cmdstat_/ { sub("cmdstat_", "", $1); printf "%s\"%s\":%s", (n++ ? "," : ""), $1, $3 } END { print "" }' |
    sed 's/^/{/; s/$/}/'
}
# Whose commands each row counts (a Redis port, "tls" for the TLS one; empty: none).
CMD_PORT=""; CMD_TLS=""
measure() { # $1 name, $2 "peak" (record $CPU_PROXY's peak RSS) or "-", rest: loadgen args
  local name=$1 rss_of=$2; shift 2
  # The direct and nginx rows are what every other row is a ratio of: always measured.
  case "$name" in
    "direct to provider"*|"nginx reverse proxy"*) ;;
    *) grep -Eq -- "$ONLY" <<<"$name" || return 0 ;;
  esac
  local rep
  for rep in $(seq "${ROW_REPS:-$REPS}"); do
    local line p0 s0 t0 p1 s1 t1 c0='{}' c1='{}' rss=-
    [ -n "$CMD_PORT" ] && c0=$(redis_calls "$CMD_PORT" "$CMD_TLS")
    # BENCH_SYSCALLS=1: the proxy's system calls and context switches over the row, counted by
    # the kernel (perf's tracepoint counters: no ptrace, so the proxy runs at its usual speed).
    local perf_out="" perf_pid="" trace_pid="" thread_pid="" sys='null' ctx='null'
    if [ -n "${BENCH_SYSCALLS:-}" ] && [ -n "$CPU_PROXY" ]; then
      perf_out="$WORK/perf-$rep.csv"
      # The proxy and its children (nginx's workers), as perf's comma-separated list.
      local pids; pids=$(echo $CPU_PROXY $(pgrep -P "$CPU_PROXY") | tr ' ' ,)
      perf stat -x, -e raw_syscalls:sys_enter,context-switches -o "$perf_out" -p "$pids" & perf_pid=$!
      # BENCH_SYSCALLS=detail BENCH_TRACE_DIR=dir: also each thread's calls by name (`perf trace -s`)
      # and each thread's CPU time and context switches.
      if [ "${BENCH_SYSCALLS}" = detail ] && [ -n "${BENCH_TRACE_DIR:-}" ]; then
        mkdir -p "$BENCH_TRACE_DIR"
        local at; at="$BENCH_TRACE_DIR/$(tr -c 'A-Za-z0-9\n' '_' <<<"$name" | head -c 120)-$rep"
        perf trace -s -o "$at.txt" -p "$pids" >/dev/null 2>&1 & trace_pid=$!
        perf stat --per-thread -e task-clock,context-switches -o "$at.threads.txt" -p "$pids" & thread_pid=$!
      fi
      sleep 0.2
    fi
    p0=$(cpu_ticks $CPU_PROXY); s0=$(cpu_ticks $CPU_STORE); t0=$(date +%s.%N)
    line=$(taskset -c $LOAD_CPU "$LOADGEN" --connections "${ROW_CONNS:-$CONNS}" --duration "${SECS}s" --warmup "${WARMUP}s" "$@")
    p1=$(cpu_ticks $CPU_PROXY); s1=$(cpu_ticks $CPU_STORE); t1=$(date +%s.%N)
    if [ -n "$perf_pid" ]; then
      kill -INT "$perf_pid" 2>/dev/null || true; wait "$perf_pid" 2>/dev/null || true
      local t
      for t in $trace_pid $thread_pid; do kill -INT "$t" 2>/dev/null || true; wait "$t" 2>/dev/null || true; done
      sys=$(awk -F, '/raw_syscalls:sys_enter/ {print $1+0}' "$perf_out"); sys=${sys:-null}
      ctx=$(awk -F, '/context-switches/ {print $1+0}' "$perf_out"); ctx=${ctx:-null}
    fi
    [ -n "$CMD_PORT" ] && c1=$(redis_calls "$CMD_PORT" "$CMD_TLS")
    [ "$rss_of" = peak ] && rss=$(peak_rss_mib "$CPU_PROXY")
    echo "{\"name\":\"$name\",\"rep\":${REP:-$rep},\"rss\":\"$rss\",\"calls\":[$c0,$c1],\"syscalls\":$sys,\"ctxsw\":$ctx,\"cpu\":{\"proxy\":$((p1 - p0)),\"store\":$((s1 - s0)),\"hz\":$HZ,\"secs\":$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')},\"result\":$line}" >> "$RESULTS"
    echo "  $name rep ${REP:-$rep}: $line" >&2
  done
}
# Runs `$1` (a function taking the build's row prefix and path) once per repetition per build,
# builds alternating, each with a proxy of its own: with one build, $REPS repetitions of each
# row; with several, the same rows side by side from one run.
each_build() {
  local rep b
  for rep in $(seq "$REPS"); do
    for b in "${BINS[@]}"; do
      local label=${b%%=*}
      REP=$rep ROW_REPS=1 "$1" "idemproxy${label:+[$label]}" "${b#*=}"
    done
  done
}

echo "direct" >&2
CPU_PROXY=""; CPU_STORE=""
measure "direct to provider" "-" --addr "127.0.0.1:$P_HTTP" --keys none
# One connection: the latency a lone agent sees, with no queueing behind other requests.
ROW_CONNS=1 measure "direct to provider, 1 connection" "-" --addr "127.0.0.1:$P_HTTP" --keys none
# The MCP stand-in called directly, as the MCP rows' reference.
if grep -Eq -- "$ONLY" <<<"mcp"; then
  measure "mcp stand-in, direct: tools/call JSON" "-" --addr "127.0.0.1:$P_HTTP" --path /mcp-json --mcp --keys none
  measure "mcp stand-in, direct: tools/call SSE" "-" --addr "127.0.0.1:$P_HTTP" --path /mcp-sse --mcp --keys none
fi
echo "nginx reverse proxy" >&2
CPU_PROXY=$NGINX_PROXY_PID; CPU_STORE=""
measure "nginx reverse proxy (no idempotency)" "-" --addr "127.0.0.1:$P_NGINX" --keys none
# nginx's own CPU per request at one connection: what one caller's unshared wake-ups cost a
# proxy that does no idempotency work, beside idemproxy's 1-connection rows.
ROW_CONNS=1 measure "nginx reverse proxy, 1 connection" "-" --addr "127.0.0.1:$P_NGINX" --keys none

# The OpenResty-style baseline: nginx + Lua + the same Redis as an idempotency gateway
# (bench/gateway.lua: SET NX the key, proxy_pass, SET the response; a retry is replayed from
# Redis). Needs Debian's libnginx-mod-http-lua; skipped without it.
if grep -Eq -- "$ONLY" <<<"gateway" && [ -f /usr/lib/nginx/modules/ngx_http_lua_module.so ]; then
  P_GATEWAY=$(free_port)
  bench/gateway.sh conf "$WORK/gateway" "$P_GATEWAY" "127.0.0.1:$P_HTTP" "127.0.0.1:$P_REDIS" >/dev/null
  taskset -c $PROXY_CPU "$NGINX" -p "$WORK/gateway" -c "$WORK/gateway/nginx.conf" & GATEWAY_PID=$!; PIDS+=($!)
  wait_port "$P_GATEWAY"
  echo "nginx + Lua + Redis gateway" >&2
  CPU_PROXY=$GATEWAY_PID; CPU_STORE=$REDIS_PID; CMD_PORT=$P_REDIS
  measure "gateway (nginx + Lua + Redis, OpenResty-style) redis: A new key per request" "-" --addr "127.0.0.1:$P_GATEWAY" --keys unique
  measure "gateway (nginx + Lua + Redis, OpenResty-style) redis: B replay (one key)" "-" --addr "127.0.0.1:$P_GATEWAY" --keys fixed
  CMD_PORT=""
  kill "$GATEWAY_PID" 2>/dev/null || true; wait "$GATEWAY_PID" 2>/dev/null || true
fi

store_rows() { # $1 row prefix, $2 build; $store, $url, $more set by the loop below
  local who=$1 db="${url}"
  # A file of its own for each proxy on the embedded store.
  [ "$store" = sqlite ] && db="sqlite://$WORK/claims-$RANDOM$RANDOM.db"
  # A database of its own for each build: builds either side of a schema migration cannot
  # share one (an older build refuses a newer schema).
  if [ "$store" = postgres ]; then
    local name; name="bench_$(printf %s "$2" | sha256sum | cut -c1-12)"
    "${PG_RUN[@]}" "$PG_BIN/psql" -q -h 127.0.0.1 -p "$P_PG" -U postgres -d postgres -tAc \
      "SELECT 1 FROM pg_database WHERE datname = '$name'" | grep -q 1 ||
      "${PG_RUN[@]}" "$PG_BIN/createdb" -h 127.0.0.1 -p "$P_PG" -U postgres "$name"
    db="postgres://postgres@127.0.0.1:$P_PG/$name?sslmode=disable"
  fi
  write_config "$WORK/$store.toml" "$db" "$more"
  start_proxy "$WORK/$store.toml" "$2"
  CPU_PROXY=$PROXY_PID
  echo "$who on $store ($PROXY_ADDR)" >&2
  # No Idempotency-Key: forwarded without touching the store. What the proxy costs before
  # any claim, the ceiling of every keyed row (measured once; the store plays no part).
  if [ $store = redis ]; then
    measure "$who, no key (forwarding only)" peak --addr "$PROXY_ADDR" --path /bench/v1/charges --keys none
  fi
  measure "$who $store: A new key per request" peak --addr "$PROXY_ADDR" --path /bench/v1/charges --keys unique
  # The same request sent as to an HTTP forward proxy (`HTTP_PROXY`): the absolute-form target
  # names the provider's host and the route is chosen by it.
  measure "$who $store: A by HTTP forward proxy" peak --addr "$PROXY_ADDR" --path http://api.bench.test/v1/charges --keys unique
  # The same with spend caps on the route (a reservation after each claim).
  measure "$who $store: A, capped route" peak --addr "$PROXY_ADDR" --path /capped/v1/charges --keys unique
  ROW_CONNS=1 measure "$who $store: A, 1 connection" peak --addr "$PROXY_ADDR" --path /bench/v1/charges --keys unique
  measure "$who $store: B replay (one key)" peak --addr "$PROXY_ADDR" --path /bench/v1/charges --keys fixed
  ROW_CONNS=1 measure "$who $store: B, 1 connection" peak --addr "$PROXY_ADDR" --path /bench/v1/charges --keys fixed
  # A replay on a capped route: answered from the claim, no budget touched.
  measure "$who $store: B, capped route" peak --addr "$PROXY_ADDR" --path /capped/v1/charges --keys fixed
  stop_proxy
}
for store in redis sqlite postgres redis-tls; do
  more=""; CMD_PORT=""; CMD_TLS=""
  case $store in
    redis) url="redis://127.0.0.1:$P_REDIS/0"; CPU_STORE=$REDIS_PID; CMD_PORT=$P_REDIS ;;
    sqlite) url=sqlite; CPU_STORE="" ;;
    postgres) [ -n "$P_PG" ] || continue
      url="postgres://postgres@127.0.0.1:$P_PG/postgres?sslmode=disable"; CPU_STORE=$PG_PID ;;
    redis-tls) url="rediss://127.0.0.1:$P_REDIS_TLS/0"; more="tls_ca = \"$WORK/bench-ca.pem\""; CPU_STORE=$REDIS_TLS_PID
      CMD_PORT=$P_REDIS_TLS; CMD_TLS=tls ;;
  esac
  each_build store_rows
done
CMD_PORT=""; CMD_TLS=""

# MCP tool calls on Redis: a new call (new arguments) is claimed, forwarded and kept; a re-run
# of one call is replayed. The SSE rows read the server's event stream as it passes (the
# streaming capture) and keep its final message.
mcp_rows() {
  write_config "$WORK/mcp.toml" "redis://127.0.0.1:$P_REDIS/0"
  mcp_route >> "$WORK/mcp.toml"
  start_proxy "$WORK/mcp.toml" "$2"
  CPU_PROXY=$PROXY_PID; CPU_STORE=$REDIS_PID; CMD_PORT=$P_REDIS; CMD_TLS=""
  echo "$1 mcp ($PROXY_ADDR)" >&2
  local f
  for f in JSON SSE; do
    local path=/mcp/mcp-$(tr '[:upper:]' '[:lower:]' <<<"$f")
    measure "$1 mcp redis: tools/call $f, A new call" peak --addr "$PROXY_ADDR" --host mcp.bench.test --path "$path" --mcp --keys unique
    measure "$1 mcp redis: tools/call $f, B re-run (replay)" peak --addr "$PROXY_ADDR" --host mcp.bench.test --path "$path" --mcp --keys fixed
  done
  CMD_PORT=""
  stop_proxy
}
each_build mcp_rows

# The embedded store without an fsync per commit: what `sqlite_synchronous = "full"` costs.
sqlite_normal_rows() {
  write_config "$WORK/sqlite-normal.toml" "sqlite://$WORK/claims-normal-$RANDOM$RANDOM.db" 'sqlite_synchronous = "normal"'
  start_proxy "$WORK/sqlite-normal.toml" "$2"
  CPU_PROXY=$PROXY_PID; CPU_STORE=""
  echo "$1 on sqlite, synchronous = normal ($PROXY_ADDR)" >&2
  measure "$1 sqlite (synchronous = normal): A" peak --addr "$PROXY_ADDR" --path /bench/v1/charges --keys unique
  stop_proxy
}
each_build sqlite_normal_rows

https_rows() {
  write_config "$WORK/tls.toml" "redis://127.0.0.1:$P_REDIS/0"
  start_proxy "$WORK/tls.toml" "$2"
  CPU_PROXY=$PROXY_PID; CPU_STORE=$REDIS_PID
  local who=${1#idemproxy}
  echo "HTTPS_PROXY$who ($PROXY_ADDR)" >&2
  measure "HTTPS_PROXY$who blind tunnel (baseline)" peak --addr "$PROXY_ADDR" --connect "localhost:$P_TUNNEL" \
    --host localhost --cacert "$WORK/bench-ca.pem" --keys none
  # First bytes: one request per tunnel, one at a time (CONNECT, the ClientHello peek, TLS,
  # the request), against the bare relay and a direct TLS connection below.
  ROW_CONNS=1 measure "HTTPS_PROXY$who blind tunnel, first bytes (a new tunnel per request, one at a time)" peak \
    --fresh --addr "$PROXY_ADDR" --connect "localhost:$P_TUNNEL" \
    --host localhost --cacert "$WORK/bench-ca.pem" --keys none
  measure "HTTPS_PROXY$who interception, no key (TLS both legs, no store)" peak --addr "$PROXY_ADDR" \
    --connect "secure.bench.test:443" --host secure.bench.test --cacert "$WORK/ca/ca.pem" --keys none
  measure "HTTPS_PROXY$who interception, redis: A" peak --addr "$PROXY_ADDR" --connect "secure.bench.test:443" \
    --host secure.bench.test --cacert "$WORK/ca/ca.pem" --keys unique
  stop_proxy
}
if [ $HAVE_TLS = 1 ]; then
  if grep -Eq -- "$ONLY" <<<"first bytes" && [ -x "$RELAY" ]; then
    CPU_PROXY=""; CPU_STORE=""
    ROW_CONNS=1 measure "direct TLS, first bytes (a new connection per request, one at a time)" "-" \
      --fresh --addr "127.0.0.1:$P_TUNNEL" --host localhost --cacert "$WORK/bench-ca.pem" --keys none
    : > "$WORK/relay.out"
    taskset -c $PROXY_CPU "$RELAY" --listen 127.0.0.1:0 > "$WORK/relay.out" & RELAY_PID=$!; PIDS+=($RELAY_PID)
    for _ in $(seq 100); do RELAY_ADDR=$(sed -n 's/^relay listening //p' "$WORK/relay.out"); [ -n "$RELAY_ADDR" ] && break; sleep 0.05; done
    CPU_PROXY=$RELAY_PID
    ROW_CONNS=1 measure "bare CONNECT relay (no peek), first bytes (a new tunnel per request, one at a time)" "-" \
      --fresh --addr "$RELAY_ADDR" --connect "localhost:$P_TUNNEL" \
      --host localhost --cacert "$WORK/bench-ca.pem" --keys none
    kill "$RELAY_PID" 2>/dev/null || true
  fi
  each_build https_rows
else
  echo "this build has no 'ca init': HTTPS_PROXY rows skipped" >&2
fi

# Memory with 1,000 idle keep-alive connections (after a warm replay run on the embedded store).
write_config "$WORK/idle.toml" "sqlite://$WORK/idle.db"
start_proxy "$WORK/idle.toml"
taskset -c $LOAD_CPU "$LOADGEN" --addr "$PROXY_ADDR" --path /bench/v1/charges --keys fixed --connections 8 --duration 2s --warmup 0s >/dev/null
taskset -c $LOAD_CPU "$LOADGEN" --addr "$PROXY_ADDR" --path /bench/v1/charges --idle 1000 --hold 4s > /dev/null & IDLE=$!
sleep 3
IDLE_RSS=$(awk '/VmRSS/ {printf "%.1f", $2/1024}' "/proc/$PROXY_PID/status")
wait $IDLE || true
stop_proxy

# One store round trip for reference.
RB=$(taskset -c $LOAD_CPU redis-benchmark -p "$P_REDIS" -c "$CONNS" -n 200000 -r 100000000 -q \
  SET "bench:__rand_int__" v NX PX 60000 2>/dev/null | tr '\r' '\n' | grep -v '^$' | tail -1)

python3 - "$RESULTS" "$SECS" "$REPS" "$CONNS" "$IDLE_RSS" "$RB" "$LOAD_CPU" "$PROXY_CPU" <<'PY'
import json, re, statistics, sys
path, secs, reps, conns, idle_rss, rb, load_cpu, proxy_cpu = sys.argv[1:]
rows = [json.loads(l) for l in open(path)]
names = list(dict.fromkeys(r["name"] for r in rows))
med = {}
for n in names:
    rs = [r for r in rows if r["name"] == n]
    m = lambda k: statistics.median(r["result"][k] for r in rs)
    # CPU per request: the share of the run's wall time each process was on a CPU, over req/s
    # (warm-up included on both sides, at the same load).
    def us_per_req(r, who):
        c = r.get("cpu")
        if not c or not r["result"]["rps"]:
            return None
        return c[who] / c["hz"] / c["secs"] / r["result"]["rps"] * 1e6
    # Redis commands per answered request (warm-up included on both sides).
    def calls_per_req(r):
        before, after = r.get("calls") or [{}, {}]
        sent = r["result"].get("sent")
        if not after or not sent:
            return None
        d = {k: (v - before.get(k, 0)) / sent for k, v in after.items()}
        return {k: v for k, v in d.items() if v >= 0.005 and k not in ("info",)}
    cpu_p = [x for x in (us_per_req(r, "proxy") for r in rs) if x]
    cpu_s = [x for x in (us_per_req(r, "store") for r in rs) if x]
    calls = [c for c in (calls_per_req(r) for r in rs) if c is not None]
    cmds = {}
    for c in calls:
        for k, v in c.items():
            cmds.setdefault(k, []).append(v)
    rps = [r["result"]["rps"] for r in rs]
    med[n] = dict(rps=m("rps"), lo=min(rps), hi=max(rps), p50=m("p50_us"), p99=m("p99_us"),
                  p999=statistics.median(r["result"].get("p999_us", 0) for r in rs),
                  cpu_proxy=statistics.median(cpu_p) if cpu_p else None,
                  cpu_store=statistics.median(cpu_s) if cpu_s else None,
                  cmds=", ".join(f"{k} {statistics.median(v):.2f}" for k, v in sorted(cmds.items())),
                  errors=sum(r["result"]["errors"] for r in rs), non2xx=sum(r["result"]["non2xx"] for r in rs),
                  rss=rs[-1]["rss"])
    # System calls and context switches per request sent (BENCH_SYSCALLS=1 only).
    per_sent = lambda k: [r[k] / r["result"]["sent"] for r in rs if r.get(k) is not None and r["result"].get("sent")]
    sc, cs = per_sent("syscalls"), per_sent("ctxsw")
    med[n]["sys"] = statistics.median(sc) if sc else None
    med[n]["ctx"] = statistics.median(cs) if cs else None
direct = med["direct to provider"]; nginx = med["nginx reverse proxy (no idempotency)"]
direct1 = med.get("direct to provider, 1 connection")
print(f"\n{conns} connections, {reps} x {secs}s per row (medians; req/s range over the repetitions), load generator + provider pinned to CPU {load_cpu}, proxy + store to CPU {proxy_cpu}.\n")
print("| scenario | req/s | req/s range | × direct | × nginx | × tunnel | p50 ms | p99 ms | p99.9 ms | proxy CPU µs/req | store CPU µs/req | Redis commands/req | errors | non-2xx | peak RSS MiB |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
counted = any(med[n]["sys"] is not None for n in names)
fmt_us = lambda v: f"{v:.1f}" if v is not None else ""
for n in names:
    r = med[n]
    # A one-connection row is compared with the one-connection direct row, not with nginx.
    one = n.endswith("1 connection") and direct1 is not None
    base = direct1 if one else direct
    xn = "" if one else f"{r['rps']/nginx['rps']:.2f}"
    xt = ""
    if n.startswith("HTTPS"):
        # The same build's blind tunnel.
        label = re.match(r"HTTPS_PROXY(\[[^\]]*\])?", n).group(1) or ""
        tunnel = med.get(f"HTTPS_PROXY{label} blind tunnel (baseline)")
        xt = f"{r['rps']/tunnel['rps']:.2f}" if tunnel and tunnel["rps"] else ""
    print(f"| {n} | {r['rps']:.0f} | {r['lo']:.0f}–{r['hi']:.0f} | {r['rps']/base['rps']:.2f} | {xn} | {xt} | "
          f"{r['p50']/1000:.3f} | {r['p99']/1000:.3f} | {r['p999']/1000:.3f} | "
          f"{fmt_us(r['cpu_proxy'])} | {fmt_us(r['cpu_store'])} | {r['cmds']} | {r['errors']} | {r['non2xx']} | {r['rss']} |")
if counted:
    print("\n| scenario | system calls/req | context switches/req |")
    print("|---|---:|---:|")
    for n in names:
        r = med[n]
        if r["sys"] is not None:
            print(f"| {n} | {r['sys']:.1f} | {r['ctx']:.2f} |" if r["ctx"] is not None else f"| {n} | {r['sys']:.1f} | |")
    print("\nCounted by the kernel for the proxy's threads (nginx: its workers) over the row, per request sent"
          " (warm-up included): `perf stat -e raw_syscalls:sys_enter,context-switches`.")
print("\nRows ending in \"1 connection\" run one connection instead (the latency one caller sees, nothing queued"
      " ahead of it); their ratio is against the direct row with one connection.")
print("\nCPU µs/req: CPU time the proxy under test (its threads; nginx: its workers) and its store server (Redis with"
      " its AOF rewrite children; PostgreSQL's postmaster and backends) used during the row, over its requests."
      " The embedded store runs inside the proxy process. Redis commands/req: Redis's own INFO commandstats over"
      " the row, per answered request (warm-up included), commands a script runs counted too.")
print(f"\nidemproxy RSS with 1,000 idle keep-alive connections (after a warm replay run): {idle_rss} MiB")
print(f"Redis SET NX PX round trip (redis-benchmark, {conns} clients): {rb}")
PY
