-- The benchmark's OpenResty-style idempotency gateway: nginx + Lua (lua-nginx-module) + Redis,
-- the baseline issue 32 compares idemproxy's scenario A with. Per keyed request, what such a
-- gateway minimally does:
--   1. SET the key NX with a "pending" marker (a claim: one round trip);
--   2. if claimed, forward the request (a subrequest through nginx's proxy_pass, keep-alive
--      to the provider) and SET the response under the key (a second round trip);
--   3. if not, GET the key: replay the stored response, or 409 while it is pending.
-- It does less than idemproxy: no request fingerprint (a reused key with another body is
-- replayed, not refused), no account scope, no fencing token (a late writer can overwrite),
-- no lease renewal or crash recovery, no log line. That is what makes it a lower bound.
--
-- Debian (bookworm) packages lua-nginx-module (libnginx-mod-http-lua) but not lua-resty-redis,
-- so this speaks RESP itself over the same non-blocking cosockets and keep-alive pool that
-- lua-resty-redis uses (ngx.socket.tcp, setkeepalive).
local M = {}

local TTL_MS = "86400000"
local concat = table.concat

local function command(sock, args)
  local out = { "*", #args, "\r\n" }
  for _, a in ipairs(args) do
    out[#out + 1] = "$"
    out[#out + 1] = #a
    out[#out + 1] = "\r\n"
    out[#out + 1] = a
    out[#out + 1] = "\r\n"
  end
  local ok, err = sock:send(out)
  if not ok then return nil, err end
  local line, rerr = sock:receive("*l")
  if not line then return nil, rerr end
  local kind = line:sub(1, 1)
  if kind == "+" then return line:sub(2) end
  if kind == ":" then return tonumber(line:sub(2)) end
  if kind == "$" then
    local n = tonumber(line:sub(2))
    if n < 0 then return ngx.null end
    local data, derr = sock:receive(n + 2)
    if not data then return nil, derr end
    return data:sub(1, n)
  end
  return nil, line
end

local function fail(status, why)
  ngx.status = status
  ngx.header["Content-Type"] = "text/plain"
  ngx.say(why)
  return ngx.exit(status)
end

local function replay(stored)
  local status, ctype, body = stored:match("^(%d+)\n([^\n]*)\n(.*)$")
  if not status then return fail(500, "bad stored response") end
  ngx.status = tonumber(status)
  ngx.header["Content-Type"] = ctype
  ngx.header["Idempotent-Replayed"] = "true"
  ngx.header["Content-Length"] = #body
  ngx.print(body)
  return ngx.exit(ngx.status)
end

function M.handle(redis_port)
  local key = ngx.var.http_idempotency_key
  if not key then
    return ngx.exec("/__provider" .. ngx.var.request_uri)
  end
  key = "idem:" .. key
  local sock = ngx.socket.tcp()
  sock:settimeout(2000)
  local ok, err = sock:connect("127.0.0.1", redis_port)
  if not ok then return fail(503, "redis: " .. err) end

  local claimed, cerr = command(sock, { "SET", key, "pending", "NX", "PX", TTL_MS })
  if claimed == nil then return fail(503, "redis: " .. tostring(cerr)) end
  if claimed == ngx.null then
    local stored = command(sock, { "GET", key })
    sock:setkeepalive(60000, 256)
    if stored == nil or stored == ngx.null or stored == "pending" then
      return fail(409, "a request with this key is in progress")
    end
    return replay(stored)
  end

  ngx.req.read_body()
  local res = ngx.location.capture("/__provider" .. ngx.var.uri, {
    method = ngx.HTTP_POST,
    body = ngx.req.get_body_data(),
    args = ngx.var.args,
  })
  if res.status >= 500 or res.truncated then
    -- Not stored: a retry may try again.
    command(sock, { "DEL", key })
  else
    local ctype = res.header["Content-Type"] or ""
    local stored = concat({ res.status, "\n", ctype, "\n", res.body })
    local set, serr = command(sock, { "SET", key, stored, "PX", TTL_MS })
    if set == nil then return fail(503, "redis: " .. tostring(serr)) end
  end
  sock:setkeepalive(60000, 256)
  ngx.status = res.status
  ngx.header["Content-Type"] = res.header["Content-Type"]
  ngx.header["Content-Length"] = #res.body
  ngx.print(res.body)
  return ngx.exit(res.status)
end

return M
