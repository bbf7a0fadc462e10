-- wrk script: POST v2 JSON bodies read from $ZIPF_BODIES (one per line), picking
-- body k (1-based) with probability proportional to 1 / k^$ZIPF_S. At the end print
-- one line "WRKJSON {...}" with the counts and latency percentiles (microseconds).
local path = os.getenv("ZIPF_BODIES")
local s = tonumber(os.getenv("ZIPF_S") or "1.0")
local target = os.getenv("ZIPF_PATH") or "/v2/models/mlp/infer"
-- With $ZIPF_BINARY=1 each line is "HEADER_LENGTH HEX": a body of Triton's binary
-- tensor extension, sent with its Inference-Header-Content-Length.
local binary = os.getenv("ZIPF_BINARY") == "1"
local bodies = {}
local heads = {}
for line in io.lines(path) do
  if binary then
    local hlen, hex = line:match("^(%d+) (%x+)$")
    bodies[#bodies + 1] = hex:gsub("%x%x", function(cc) return string.char(tonumber(cc, 16)) end)
    heads[#heads + 1] = { ["Content-Type"] = "application/octet-stream",
                          ["Inference-Header-Content-Length"] = hlen }
  else
    bodies[#bodies + 1] = line
  end
end
local n = #bodies
local cdf = {}
local total = 0.0
for k = 1, n do
  total = total + 1.0 / (k ^ s)
  cdf[k] = total
end
for k = 1, n do
  cdf[k] = cdf[k] / total
end
local headers = { ["Content-Type"] = "application/json" }

init = function(args)
  math.randomseed(os.time() + tonumber(tostring({}):sub(8), 16) % 100000)
end

request = function()
  local u = math.random()
  local lo, hi = 1, n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] < u then lo = mid + 1 else hi = mid end
  end
  return wrk.format("POST", target, binary and heads[lo] or headers, bodies[lo])
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"err_status":%d,"err_timeout":%d,' ..
    '"err_connect":%d,"err_read":%d,"err_write":%d,' ..
    '"p50_us":%d,"p99_us":%d,"max_us":%d}\n',
    summary.requests, summary.duration, e.status, e.timeout, e.connect, e.read, e.write,
    latency:percentile(50), latency:percentile(99), latency.max))
end
