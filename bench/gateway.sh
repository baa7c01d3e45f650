#!/usr/bin/env bash
# Writes the nginx configuration of the benchmark's nginx + Lua + Redis idempotency gateway
# (bench/gateway.lua) into a directory, for bench/run.sh and bench/callgrind.sh:
#
#   bench/gateway.sh conf DIR LISTEN_PORT PROVIDER_ADDR REDIS_ADDR
#   nginx -p DIR -c DIR/nginx.conf
#
# Needs Debian's lua-nginx-module: apt-get install libnginx-mod-http-lua (it brings
# libnginx-mod-http-ndk, lua-resty-core and LuaJIT).
set -euo pipefail
[ "${1:-}" = conf ] && [ $# = 5 ] || { echo "usage: $0 conf DIR LISTEN_PORT PROVIDER_ADDR REDIS_ADDR" >&2; exit 2; }
dir=$2 port=$3 provider=$4 redis=$5
modules=/usr/lib/nginx/modules
for m in ndk_http_module ngx_http_lua_module; do
  [ -f "$modules/$m.so" ] || { echo "missing $modules/$m.so (apt-get install libnginx-mod-http-lua)" >&2; exit 1; }
done
mkdir -p "$dir"
cp "$(dirname "$0")/gateway.lua" "$dir/gateway.lua"
cat > "$dir/nginx.conf" <<NGX
load_module $modules/ndk_http_module.so;
load_module $modules/ngx_http_lua_module.so;
worker_processes 1; daemon off; pid $dir/pid; error_log $dir/error.log;
events { worker_connections 8192; }
http {
  access_log off; keepalive_requests 1000000; keepalive_timeout 120s;
  client_body_temp_path $dir; proxy_temp_path $dir;
  lua_package_path "$dir/?.lua;/usr/share/lua/5.1/?.lua;;";
  # Loaded by the master, as root: the workers (nobody) may not read a private directory.
  init_by_lua_block { gateway = require("gateway") }
  upstream provider { server $provider; keepalive 64; }
  server { listen 127.0.0.1:$port;
    client_body_buffer_size 16k;
    location / { content_by_lua_block { gateway.handle(${redis##*:}) } }
    location /__provider/ { internal; proxy_pass http://provider/; proxy_http_version 1.1; proxy_set_header Connection ""; }
  }
}
NGX
echo "$dir/nginx.conf"
