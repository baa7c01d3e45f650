#!/usr/bin/env bash
# The soak: the embedded store (SQLite, `synchronous = full`) under unique keys at 32
# connections for a long run, one row per minute (p50, p99, p99.9), and at the end the
# database's bytes on disk (the database file, its WAL and shared-memory file) per claimed
# request.
#
#   bench/soak.sh                         # 600 s, 32 connections, SQLite
#   BENCH_SOAK=180 bench/soak.sh          # shorter
#   BENCH_SOAK_STEP=30 BENCH_CONNS=8 BENCH_BIN=/tmp/old/idemproxy bench/soak.sh
#
# Each row also says what the store's writer thread (`sqlite-store`, which runs every
# transaction) did per request in that step, from /proc/PID/task/TID/io and schedstat: its
# read calls (SQLite's page-cache misses; the OS's cache answers most), the bytes it read and
# wrote (WAL frames, checkpoint copies), and its CPU time.
#
# Same pinning as bench/run.sh: load generator + provider on CPU 0, the proxy (its SQLite
# writer inside it) on CPU 1. Every minute is its own load generator run on fresh
# connections (a new process, so new keys), against the one proxy and database. Only
# loopback; everything it starts stops with it.
set -euo pipefail
cd "$(dirname "$0")/.."
TOTAL=${BENCH_SOAK:-600}
STEP=${BENCH_SOAK_STEP:-60}
CONNS=${BENCH_CONNS:-32}
LOADGEN=${BENCH_LOADGEN:-target/release/examples/loadgen}
BIN=${BENCH_BIN:-target/release/idemproxy}
if [ -z "${BENCH_LOADGEN:-}" ]; then
  cargo build --release --locked --quiet --bin idemproxy --example loadgen
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
for tool in "$NGINX" python3 taskset; do
  command -v "$tool" >/dev/null || { echo "missing: $tool" >&2; exit 1; }
done
if [ "$(nproc)" -ge 2 ]; then LOAD_CPU=0; PROXY_CPU=1; else LOAD_CPU=0; PROXY_CPU=0; fi

WORK=$(mktemp -d /tmp/idemproxy-soak.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

P_HTTP=$(free_port)
BODY='{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":2000,"amount_captured":2000,"balance_transaction":"txn_3MmlLrLkdIwHu7ix0uke3Ezy","captured":true,"created":1679090539,"currency":"usd","livemode":false,"paid":true,"status":"succeeded","outcome":{"network_status":"approved_by_network","risk_level":"normal","type":"authorized"}}'
mkdir -p "$WORK/nginx"
cat > "$WORK/nginx/nginx.conf" <<NGX
worker_processes 1; daemon off; pid $WORK/nginx/pid; error_log $WORK/nginx/error.log;
events { worker_connections 8192; }
http {
  access_log off; keepalive_requests 1000000; keepalive_timeout 120s;
  client_body_temp_path $WORK/nginx; proxy_temp_path $WORK/nginx;
  server { listen 127.0.0.1:$P_HTTP; location / { default_type application/json; return 200 '$BODY'; } }
}
NGX
taskset -c $LOAD_CPU "$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" & PIDS+=($!)
wait_port "$P_HTTP"

DB="$WORK/claims.db"
cat > "$WORK/proxy.toml" <<TOML
[server]
listen = "127.0.0.1:0"
[store]
url = "sqlite://$DB"
[[routes]]
name = "bench"
prefix = "/bench"
host = "api.bench.test"
upstream = "http://api.bench.test"
connect_to = "127.0.0.1:$P_HTTP"
provider = "stripe"
key_source = "client"
TOML
taskset -c $PROXY_CPU "$BIN" serve --config "$WORK/proxy.toml" > "$WORK/proxy.out" 2> "$WORK/proxy.err" & PROXY_PID=$!; PIDS+=($PROXY_PID)
ADDR=""
for _ in $(seq 200); do
  ADDR=$(sed -n 's/^idemproxy listening proxy=\([^ ]*\).*/\1/p' "$WORK/proxy.out")
  [ -n "$ADDR" ] && break
  sleep 0.05
done
[ -n "$ADDR" ] || { echo "idemproxy did not start:" >&2; cat "$WORK/proxy.err" >&2; exit 1; }

WRITER_TID=""
for t in /proc/"$PROXY_PID"/task/*; do
  [ "$(cat "$t/comm" 2>/dev/null)" = sqlite-store ] && WRITER_TID=${t##*/}
done
# syscr rchar syscw wchar cpu-ns of the writer thread, as one JSON array.
writer_io() {
  local t=/proc/$PROXY_PID/task/$WRITER_TID
  if [ -n "$WRITER_TID" ] && [ -r "$t/io" ]; then
    awk -v cpu="$(cut -d' ' -f1 "$t/schedstat")" \
      '{v[$1]=$2} END {printf "[%d,%d,%d,%d,%d]", v["syscr:"], v["rchar:"], v["syscw:"], v["wchar:"], cpu}' "$t/io"
  else
    echo '[0,0,0,0,0]'
  fi
}
RESULTS="$WORK/soak.jsonl"; : > "$RESULTS"
HZ=$(getconf CLK_TCK)
echo "soak: ${TOTAL}s at $CONNS connections on SQLite, a row every ${STEP}s (load average at start: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
elapsed=0
while [ "$elapsed" -lt "$TOTAL" ]; do
  step=$STEP; [ $((TOTAL - elapsed)) -lt "$step" ] && step=$((TOTAL - elapsed))
  io_before=$(writer_io)
  line=$(taskset -c $LOAD_CPU "$LOADGEN" --addr "$ADDR" --path /bench/v1/charges --keys unique \
    --connections "$CONNS" --duration "${step}s" --warmup 0s)
  elapsed=$((elapsed + step))
  bytes=$(cat "$DB" "$DB-wal" 2>/dev/null | wc -c)
  load=$(cut -d' ' -f1 /proc/loadavg)
  echo "{\"t\":$elapsed,\"load\":$load,\"db_wal_bytes\":$bytes,\"io\":[$io_before,$(writer_io)],\"result\":$line}" >> "$RESULTS"
  echo "  ${elapsed}s: $line (db+wal $bytes bytes, load $load)" >&2
done
DB_BYTES=$(stat -c %s "$DB"); WAL_BYTES=$(stat -c %s "$DB-wal" 2>/dev/null || echo 0); SHM_BYTES=$(stat -c %s "$DB-shm" 2>/dev/null || echo 0)
RSS=$(awk '/VmHWM/ {printf "%.1f", $2/1024}' "/proc/$PROXY_PID/status")
CPU=$(awk '{print $14+$15}' "/proc/$PROXY_PID/stat")
kill "$PROXY_PID"; wait "$PROXY_PID" 2>/dev/null || true
# After a clean stop (the last connection checkpoints the WAL into the database).
DB_AFTER=$(stat -c %s "$DB"); WAL_AFTER=$(stat -c %s "$DB-wal" 2>/dev/null || echo 0)

python3 - "$RESULTS" "$CONNS" "$DB_BYTES" "$WAL_BYTES" "$SHM_BYTES" "$DB_AFTER" "$WAL_AFTER" "$RSS" "$CPU" "$HZ" <<'PY'
import json, sys
path, conns, db, wal, shm, db_after, wal_after, rss, cpu, hz = sys.argv[1:]
rows = [json.loads(l) for l in open(path)]
print(f"\nsoak, SQLite (synchronous = full), unique keys, {conns} connections; one row per load generator run\n")
print("| until s | req/s | p50 ms | p99 ms | p99.9 ms | max ms | errors | non-2xx | db+WAL MB | load avg "
      "| writer reads/req | writer KB read/req | writer KB written/req | writer CPU µs/req |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
sent = 0
for r in rows:
    x = r["result"]; sent += x["sent"]
    (r0, rb0, w0, wb0, c0), (r1, rb1, w1, wb1, c1) = r.get("io", [[0] * 5, [0] * 5])
    n = max(x["sent"], 1)
    print(f"| {r['t']} | {x['rps']:.0f} | {x['p50_us']/1000:.2f} | {x['p99_us']/1000:.2f} | {x.get('p999_us',0)/1000:.2f} | "
          f"{x.get('max_us',0)/1000:.1f} | {x['errors']} | {x['non2xx']} | {r['db_wal_bytes']/1e6:.1f} | {r['load']} "
          f"| {(r1-r0)/n:.2f} | {(rb1-rb0)/n/1024:.2f} | {(wb1-wb0)/n/1024:.2f} | {(c1-c0)/n/1000:.1f} |")
db, wal, shm, db_after, wal_after = map(int, (db, wal, shm, db_after, wal_after))
print(f"\nrequests answered: {sent}; proxy CPU {int(cpu)/int(hz)/max(sent,1)*1e6:.1f} µs/req over the whole soak; peak RSS {rss} MiB")
print(f"on disk at the end, running: database {db:,} B + WAL {wal:,} B (+ shm {shm:,} B) = {(db+wal)/max(sent,1):,.0f} B per request (database alone {db/max(sent,1):,.0f})")
print(f"after a clean stop: database {db_after:,} B + WAL {wal_after:,} B = {(db_after+wal_after)/max(sent,1):,.0f} B per request")
PY
# Where the database's bytes are: each table and index (SQLite's dbstat), per request.
python3 - "$DB" "$RESULTS" <<'PY'
import json, sqlite3, sys
db, results = sys.argv[1:]
sent = sum(json.loads(l)["result"]["sent"] for l in open(results))
c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
try:
    rows = c.execute("SELECT name, SUM(pgsize), SUM(payload), SUM(unused), COUNT(*) FROM dbstat GROUP BY name ORDER BY 2 DESC").fetchall()
except sqlite3.Error as e:
    print(f"\n(no dbstat: {e})"); sys.exit(0)
print("\n| table or index | pages | bytes per request | payload per request | unused per request |")
print("|---|---:|---:|---:|---:|")
for name, size, payload, unused, pages in rows:
    print(f"| {name} | {pages:,} | {size/max(sent,1):,.0f} | {payload/max(sent,1):,.0f} | {unused/max(sent,1):,.0f} |")
PY
