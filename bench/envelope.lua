-- wrk script for bench/run.py: POST a body read from a template file, with "@ID@"
-- replaced by a per-request unique id (so each envelope has its own correlation_id and
-- so its own derived idempotency key: the sidecar's idempotency store fills up).
--
--   wrk -t1 -c16 -d10s -s bench/envelope.lua URL -- PREFIX TEMPLATE_FILE
--
-- With WRK_STOP_AFTER=N in the environment the run ends after N answers (use -t1; defining
-- response() costs wrk a little per answer, so it is only defined then).
-- WRK_HEADERS adds request headers (see below).
-- done() prints one line "BENCH_JSON {...}" with counts and latency percentiles (us).

local thread_counter = 0

function setup(thread)
  thread_counter = thread_counter + 1
  thread:set("tid", thread_counter)
end

local head, tail, fixed
local n = 0
local headers = { ["Content-Type"] = "application/json" }
-- WRK_HEADERS: more request headers, one "Name: value" per line (bench/peers.py).
for line in string.gmatch(os.getenv("WRK_HEADERS") or "", "[^\n]+") do
  local name, value = string.match(line, "^([^:]+):%s*(.*)$")
  if name then
    headers[name] = value
  end
end

function init(args)
  local prefix = args[1] or "run"
  local f = assert(io.open(args[2], "rb"))
  local template = f:read("*a")
  f:close()
  local at = string.find(template, "@ID@", 1, true)
  if at then
    head = string.sub(template, 1, at - 1) .. prefix .. "-" .. tostring(tid) .. "-"
    tail = string.sub(template, at + 4)
  else
    fixed = wrk.format("POST", nil, headers, template)
  end
end

function request()
  if fixed then
    return fixed
  end
  n = n + 1
  return wrk.format("POST", nil, headers, head .. n .. tail)
end

local stop_after = tonumber(os.getenv("WRK_STOP_AFTER") or "0")
if stop_after > 0 then
  local answered = 0
  function response(status, hdrs, body)
    answered = answered + 1
    if answered == stop_after then
      wrk.thread:stop()
      -- wrk's main thread sleeps for -d regardless; SIGINT ends the sleep, then it
      -- reports as usual. The signal must reach the main thread, which it does once
      -- this thread has exited: so a background shell ($PPID is wrk) repeats it until
      -- wrk is gone. popen, unlike system(), leaves wrk's SIGINT handler in place.
      io.popen("(for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do " ..
               "sleep 0.25; kill -INT $PPID 2>/dev/null || exit 0; done) " ..
               ">/dev/null 2>&1 &"):close()
    end
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"errors_connect":%d,' ..
    '"errors_read":%d,"errors_write":%d,"errors_status":%d,"errors_timeout":%d,' ..
    '"lat_mean_us":%.1f,"lat_p50_us":%d,"lat_p90_us":%d,"lat_p99_us":%d,' ..
    '"lat_p999_us":%d,"lat_max_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency.mean, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max))
end
