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
WARMUP=${BENCH_WARMUP:-2}   # seconds; longer where handshakes and a loaded machine slow the start
ROWS=${BENCH_ROWS:-redis-A redis-B redis-capped-A redis-capped-B sqlite-A sqlite-B}
for tool in valgrind callgrind_control redis-server python3 nginx openssl; do
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

P_HTTP=$(free_port); P_REDIS=$(free_port); P_TLS=$(free_port); P_TUNNEL=$(free_port)
P_NGINX=$(free_port); P_GATEWAY=$(free_port)
UPSTREAM_KEEPALIVE=${BENCH_UPSTREAM_KEEPALIVE:-1000000}
# A bench CA and a leaf for the provider's TLS ports (as in bench/run.sh).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj "/CN=bench CA" \
  -keyout "$WORK/bench-ca.key" -out "$WORK/bench-ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=api.bench.test" \
  -keyout "$WORK/leaf.key" -out "$WORK/leaf.csr" 2>/dev/null
printf 'subjectAltName=DNS:api.bench.test,DNS:secure.bench.test,DNS:localhost\nextendedKeyUsage=serverAuth\n' > "$WORK/leaf.ext"
openssl x509 -req -in "$WORK/leaf.csr" -CA "$WORK/bench-ca.pem" -CAkey "$WORK/bench-ca.key" -CAcreateserial \
  -days 2 -extfile "$WORK/leaf.ext" -out "$WORK/leaf.pem" 2>/dev/null
# The MCP stand-in's answer to a tools/call (see bench/run.sh).
MCP_RESULT='{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"refund re_3MmlLrLkdIwHu7ix0kLZc9Ps of 2000 usd on ch_3MmlLrLkdIwHu7ix0snN0B15: succeeded"}],"isError":false}}'
BODY='{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":2000,"amount_captured":2000,"balance_transaction":"txn_3MmlLrLkdIwHu7ix0uke3Ezy","captured":true,"created":1679090539,"currency":"usd","livemode":false,"paid":true,"status":"succeeded","outcome":{"network_status":"approved_by_network","risk_level":"normal","type":"authorized"}}'
mkdir -p "$WORK/nginx" "$WORK/nginx-proxy"
cat > "$WORK/nginx/nginx.conf" <<NGX
worker_processes 1; daemon off; pid $WORK/nginx/pid; error_log $WORK/nginx/error.log;
events { worker_connections 1024; }
http {
  access_log off; keepalive_requests 1000000; keepalive_timeout 120s;
  client_body_temp_path $WORK/nginx; proxy_temp_path $WORK/nginx;
  # One line per new TLS connection: r = the session was resumed, . = a full handshake.
  map \$connection_requests \$first_on_connection { 1 1; default 0; }
  log_format handshakes '\$ssl_session_reused \$ssl_protocol';
  server { listen 127.0.0.1:$P_HTTP; location / { default_type application/json; return 200 '$BODY'; }
    location = /mcp-json { default_type application/json; return 200 '$MCP_RESULT'; }
    location = /mcp-sse { default_type text/event-stream; return 200 'event: message\ndata: $MCP_RESULT\n\n'; } }
  server { listen 127.0.0.1:$P_TLS ssl; ssl_certificate $WORK/leaf.pem; ssl_certificate_key $WORK/leaf.key;
    keepalive_requests $UPSTREAM_KEEPALIVE;
    access_log $WORK/nginx/handshakes.log handshakes if=\$first_on_connection;
    location / { default_type application/json; return 200 '$BODY'; } }
  server { listen 127.0.0.1:$P_TUNNEL ssl; ssl_certificate $WORK/leaf.pem; ssl_certificate_key $WORK/leaf.key;
    location / { default_type application/json; return 200 '$BODY'; } }
}
NGX
# nginx as the plain reverse proxy of bench/run.sh's reference row, one process so that
# callgrind sees all its work; and the nginx + Lua + Redis gateway (bench/gateway.sh).
cat > "$WORK/nginx-proxy/nginx.conf" <<NGX
master_process off; worker_processes 1; daemon off; pid $WORK/nginx-proxy/pid; error_log $WORK/nginx-proxy/error.log;
events { worker_connections 1024; }
http {
  access_log off; keepalive_requests 1000000; keepalive_timeout 120s;
  client_body_temp_path $WORK/nginx-proxy; proxy_temp_path $WORK/nginx-proxy;
  upstream provider { server 127.0.0.1:$P_HTTP; keepalive 64; }
  server { listen 127.0.0.1:$P_NGINX;
           location / { proxy_pass http://provider; proxy_http_version 1.1; proxy_set_header Connection ""; } }
}
NGX
"$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" & PIDS+=($!)
redis-server --port "$P_REDIS" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync everysec \
  --dir "$WORK" --logfile "$WORK/redis.log" & PIDS+=($!)
wait_port "$P_HTTP"; wait_port "$P_REDIS"; wait_port "$P_TLS"
HAVE_TLS=0
if "${builds[0]#*=}" ca init --help >/dev/null 2>&1; then
  "${builds[0]#*=}" ca init --dir "$WORK/ca" >/dev/null && HAVE_TLS=1
fi

write_config() { # $1 file, $2 store url
  cat > "$1" <<TOML
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
[admin]
token_sha256 = "$(printf %s bench-admin-token | sha256sum | cut -d' ' -f1)"
[store]
url = "$2"
$( [ $HAVE_TLS = 1 ] && printf '[tls]\nca_cert = "%s"\nca_key = "%s"\nconnect_ports = [443, %s]\ntunnel_hosts = ["localhost"]\n' "$WORK/ca/ca.pem" "$WORK/ca/ca.key" "$P_TUNNEL" )
$( [ $HAVE_TLS = 1 ] && printf '[egress]\nallow = ["127.0.0.1:%s", "localhost:%s"]\n' "$P_TLS" "$P_TUNNEL" )
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
RESULTS="$WORK/results.tsv"; : > "$RESULTS"
# Starts what a row measures under callgrind; sets `pid` and `addr`.
start_measured() { # $1 build, $2 row, $3 callgrind output file
  local bin=$1 row=$2 out=$3 url
  case $row in
    nginx)
      taskset -c 1 valgrind --tool=callgrind --collect-atstart=yes --callgrind-out-file="$out.%p" \
        "$NGINX" -p "$WORK/nginx-proxy" -c "$WORK/nginx-proxy/nginx.conf" 2> "$WORK/proxy.err" & pid=$!; PIDS+=($pid)
      addr=127.0.0.1:$P_NGINX; wait_port "$P_NGINX"; return ;;
    gateway-*)
      bench/gateway.sh conf "$WORK/gateway" "$P_GATEWAY" "127.0.0.1:$P_HTTP" "127.0.0.1:$P_REDIS" > /dev/null
      # LuaJIT writes machine code at run time: valgrind must look for it outside the stack.
      taskset -c 1 valgrind --tool=callgrind --smc-check=all-non-file --collect-atstart=yes --callgrind-out-file="$out.%p" \
        "$NGINX" -p "$WORK/gateway" -c "$WORK/gateway/nginx.conf" -g 'master_process off;' 2> "$WORK/proxy.err" & pid=$!; PIDS+=($pid)
      addr=127.0.0.1:$P_GATEWAY; wait_port "$P_GATEWAY"; return ;;
  esac
  case $row in
    sqlite-*) url="sqlite://$WORK/claims-$RANDOM$RANDOM.db" ;;
    *) url="redis://127.0.0.1:$P_REDIS/0" ;;
  esac
  write_config "$WORK/proxy.toml" "$url"
  case $row in mcp-*) mcp_route >> "$WORK/proxy.toml" ;; esac
  : > "$WORK/proxy.out"
  taskset -c 1 valgrind --tool=callgrind --collect-atstart=yes --callgrind-out-file="$out.%p" \
    "$bin" serve --config "$WORK/proxy.toml" > "$WORK/proxy.out" 2> "$WORK/proxy.err" & pid=$!; PIDS+=($pid)
  addr=""
  for _ in $(seq 600); do
    addr=$(sed -n 's/^idemproxy listening proxy=\([^ ]*\).*/\1/p' "$WORK/proxy.out")
    [ -n "$addr" ] && break
    sleep 0.1
  done
  [ -n "$addr" ] || { echo "the proxy did not start:" >&2; cat "$WORK/proxy.err" >&2; exit 1; }
}
handshakes() { # full and resumed TLS handshakes the upstream has logged so far
  awk '$1 == "r" { r++ } $1 != "r" { f++ } END { printf "%d %d", f, r }' "$WORK/nginx/handshakes.log" 2>/dev/null || echo "0 0"
}
run_row() { # $1 label, $2 build, $3 row
  local label=$1 bin=$2 row=$3 keys out pid addr load=()
  case $row in *-A) keys=unique ;; *-B) keys=fixed ;; *) keys=none ;; esac
  case $row in
    *capped*) load=(--path /capped/v1/charges) ;;
    mcp-json-*) load=(--path /mcp/mcp-json --mcp --host mcp.bench.test) ;;
    mcp-sse-*) load=(--path /mcp/mcp-sse --mcp --host mcp.bench.test) ;;
    nginx | gateway-*) load=(--path /v1/charges) ;;
    tunnel) load=(--connect "localhost:$P_TUNNEL" --host localhost --cacert "$WORK/bench-ca.pem") ;;
    tls-*) load=(--connect "secure.bench.test:443" --host secure.bench.test --cacert "$WORK/ca/ca.pem") ;;
    *) load=(--path /bench/v1/charges) ;;
  esac
  case $row in tunnel | tls-*) [ $HAVE_TLS = 1 ] || { echo "  $row: this build has no 'ca init', skipped" >&2; return 0; } ;; esac
  out="$WORK/cg.$label.$row"
  start_measured "$bin" "$row" "$out"
  local h0 h1 h2
  h0=$(handshakes)
  taskset -c 0 "$LOADGEN" --addr "$addr" --keys "$keys" "${load[@]}" --connections "$CONNS" --duration "${WARMUP}s" --warmup 0s >/dev/null
  callgrind_control -z "$pid" >/dev/null
  local line sent
  h1=$(handshakes)
  line=$(taskset -c 0 "$LOADGEN" --addr "$addr" --keys "$keys" "${load[@]}" --connections "$CONNS" --duration "${SECS}s" --warmup 0s)
  callgrind_control -d "$pid" >/dev/null
  h2=$(handshakes)
  sent=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["sent"] if r["errors"] + r["non2xx"] == 0 else -r["sent"])' "$line")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  # The dump after the zeroing holds the measured requests only.
  local dump ir
  dump=$(ls -t "$out".*.1 2>/dev/null | head -1 || true)
  [ -n "$dump" ] || dump=$(ls -t "$out".* | grep -v '\.1$' | head -1)
  ir=$(sed -n 's/^summary: \([0-9]*\).*/\1/p; s/^totals: \([0-9]*\).*/\1/p' "$dump" | head -1)
  # Upstream handshakes: full/resumed in the warm-up, full/resumed while measured.
  local hs
  hs=$(python3 -c 'import sys; a,b,c=[list(map(int,x.split())) for x in sys.argv[1:]]; print(f"{b[0]-a[0]}/{b[1]-a[1]}, {c[0]-b[0]}/{c[1]-b[1]}")' "$h0" "$h1" "$h2")
  printf '%s\t%s\t%s\t%s\t%s\n' "$label" "$row" "$ir" "$sent" "$hs" >> "$RESULTS"
  echo "  ${label:-this build} $row: $ir instructions / $sent requests (upstream TLS handshakes full/resumed, warm-up then measured: $hs)" >&2
  if [ -n "${BENCH_KEEP:-}" ]; then mkdir -p "$BENCH_KEEP"; cp "$dump" "$BENCH_KEEP/callgrind.${label:-build}.$row"; fi
}
for row in $ROWS; do
  for b in "${builds[@]}"; do
    case $b in *=*) label=${b%%=*}; bin=${b#*=} ;; *) label=""; bin=$b ;; esac
    run_row "$label" "$bin" "$row"
  done
done
python3 - "$RESULTS" "$CONNS" "$SECS" "$WARMUP" <<'PY'
import sys
path, conns, secs, warmup = sys.argv[1:]
rows = [l.rstrip("\n").split("\t") for l in open(path)]
print(f"\ncallgrind, {conns} connections, {secs} s per row after a {warmup} s warm-up, proxy on one CPU: user-space instructions per answered request (all threads)\n")
print("| build | row | instructions/req | requests | upstream TLS handshakes full/resumed: warm-up, measured |")
print("|---|---|---:|---:|---|")
for label, row, ir, sent, hs in rows:
    # A negative count: the load generator saw errors or non-2xx answers; the row is void.
    n = int(sent)
    per = f"{int(ir)/n:,.0f}" if n > 0 else "VOID (errors)"
    shown = hs if row.startswith(("tls", "tunnel")) else ""
    print(f"| {label or 'this build'} | {row} | {per} | {abs(n)} | {shown} |")
PY
