"""Ratios, targets and the printed table of bench/run.py (pure: results dict in, text out)."""

from __future__ import annotations

from typing import Any

#: Issue 21's targets ("Performance, round two"), as measured by this benchmark.
TARGET_THROUGHPUT_RATIO = 0.5  # envelope route req/s / pass-through req/s, at c16
TARGET_PROXY_RATIO = 0.75  # drop-in route req/s / pass-through req/s, at c16
TARGET_ADDED_P50_MS = 0.4  # at concurrency 1
#: Sidecar CPU per call at c16: 280 us where the pass-through took 144 us (the issue's
#: machine); on another machine scaled by this run's pass-through CPU per call.
TARGET_CPU_US = 280.0
ISSUE_PASSTHROUGH_CPU_US = 144.0
TARGET_IDLE_RSS_MIB = 50.0  # after the first call
TARGET_LOAD_RSS_MIB = 80.0  # peak (VmHWM) after the runs at up to 64 connections
#: Issue 35's ("Performance, round three") that this benchmark measures: the drop-in
#: route at least as fast as the envelope route (req/s at c16, added p50 at c1), and
#: RSS after the first call. Its stream targets are bench/streams.py's, its instruction
#: counts (the controls' cost) bench/instructions.py's.
TARGET_DROP_IN_VS_ENVELOPE = 1.0  # drop-in req/s / envelope req/s, at c16
TARGET_RSS_MIB_35 = 48.0
#: "Flat": RSS after the soak exceeds RSS after 10k calls by at most this much...
FLAT_SLACK_MIB = 2.0
#: ...or by at most this fraction, whichever is larger.
FLAT_SLACK_FRACTION = 0.05


def _run(main: list[dict[str, Any]], label: str, conc: int) -> dict[str, Any]:
    return next(r for r in main if r["label"] == label and r["concurrency"] == conc)


def _added_ms(main: list[dict[str, Any]], label: str, conc: int, pct: str) -> float:
    base = _run(main, "direct", conc)["latency_us"][pct]
    return round((_run(main, label, conc)["latency_us"][pct] - base) / 1000, 3)


def _target(value: float | None, op: str, bound: float) -> dict[str, Any]:
    met = value is not None and (value >= bound if op == ">=" else value <= bound)
    return {"target": f"{op} {bound:g}", "value": value, "met": met}


def _present(main: list[dict[str, Any]], labels: tuple[str, ...]) -> tuple[str, ...]:
    """The labels a run has (results from before the proxy route have no ``proxy``)."""
    seen = {run["label"] for run in main}
    return tuple(label for label in labels if label in seen)


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    main = results["main"]
    rps = {
        s: {f"c{c}": _run(main, s, c)["rps"] for c in (16, 64)}
        for s in _present(main, ("direct", "passthrough", "sidecar", "proxy"))
    }
    pairs = (("sidecar", "passthrough"), ("sidecar", "direct"), ("passthrough", "direct"))
    pairs += (("proxy", "passthrough"),) if "proxy" in rps else ()
    ratios = {
        f"{a}_vs_{b}": {k: round(rps[a][k] / rps[b][k], 3) for k in ("c16", "c64")}
        for a, b in pairs
    }
    added = {
        s: {f"c{c}": {p: _added_ms(main, s, c, p) for p in ("p50", "p99")} for c in (1, 16)}
        for s in _present(main, ("passthrough", "sidecar", "proxy"))
    }
    cpu = {
        s: {
            f"c{c}": _run(main, s, c)["cpu_us_per_call"].get("sidecar" if s == "proxy" else s)
            for c in (1, 16, 64)
        }
        for s in _present(main, ("passthrough", "sidecar", "proxy"))
    }
    peak_mib = round(results["sidecar_memory_kib"]["VmHWM"] / 1024, 1)
    soak = results.get("soak") or {}
    points = soak.get("points") or []
    soak_summary: dict[str, Any] = {}
    if len(points) >= 2:
        first, last = points[0], points[-1]
        growth = (last["rss_kib"] - first["rss_kib"]) / 1024
        soak_summary = {
            "calls_first": first["calls"],
            "rss_first_mib": round(first["rss_kib"] / 1024, 1),
            "calls_last": last["calls"],
            "rss_last_mib": round(last["rss_kib"] / 1024, 1),
            "hwm_mib": round(last["hwm_kib"] / 1024, 1),
            "growth_mib": round(growth, 1),
            "stopped": soak.get("stopped"),
        }
    features = []
    full = next((f for f in results.get("features", []) if f["variant"] == "full"), None)
    direct_c1 = _run(main, "direct", 1)["latency_us"]
    for f in results.get("features", []):
        name = f"sidecar-{f['variant']}"
        cpu_f = f["c16"]["cpu_us_per_call"].get(name)
        full_cpu = full["c16"]["cpu_us_per_call"].get("sidecar-full") if full else None
        features.append({
            "variant": f["variant"],
            "off": f["off"],
            "rps_c16": f["c16"]["rps"],
            "cpu_us_per_call": cpu_f,
            "cpu_saved_us": round(full_cpu - cpu_f, 1) if full_cpu and cpu_f else None,
            "added_p50_ms_c1": round((f["c1"]["latency_us"]["p50"] - direct_c1["p50"]) / 1000, 3),
            "added_p99_ms_c1": round((f["c1"]["latency_us"]["p99"] - direct_c1["p99"]) / 1000, 3),
        })  # fmt: skip
    cpu16 = cpu["sidecar"]["c16"]
    pt_cpu = cpu["passthrough"]["c16"]
    scale = (pt_cpu or ISSUE_PASSTHROUGH_CPU_US) / ISSUE_PASSTHROUGH_CPU_US
    cpu_bound = round(TARGET_CPU_US * scale)
    targets = {
        "envelope_ratio_c16": _target(
            ratios["sidecar_vs_passthrough"]["c16"], ">=", TARGET_THROUGHPUT_RATIO
        ),
        "cpu_us_per_call_c16": _target(cpu16, "<=", cpu_bound),
        "added_p50_ms_c1": _target(added["sidecar"]["c1"]["p50"], "<=", TARGET_ADDED_P50_MS),
    }
    if "proxy_vs_passthrough" in ratios:
        targets["proxy_ratio_c16"] = _target(
            ratios["proxy_vs_passthrough"]["c16"], ">=", TARGET_PROXY_RATIO
        )
    idle = results.get("sidecar_idle_memory_kib")
    if idle:
        targets["rss_idle_mib"] = _target(round(idle["VmRSS"] / 1024, 1), "<=", TARGET_IDLE_RSS_MIB)
    targets["rss_load_mib"] = _target(peak_mib, "<=", TARGET_LOAD_RSS_MIB)
    if soak_summary:
        slack = max(FLAT_SLACK_MIB, FLAT_SLACK_FRACTION * soak_summary["rss_first_mib"])
        targets["rss_flat"] = {
            "target": f"growth {soak_summary['calls_first']:,} -> "
            f"{soak_summary['calls_last']:,} calls <= {slack:.1f} MiB",
            "value": soak_summary["growth_mib"],
            "met": soak_summary["growth_mib"] <= slack,
        }
    targets_35: dict[str, Any] = {}
    if "proxy" in rps:
        targets_35["drop_in_vs_envelope_c16"] = _target(
            round(rps["proxy"]["c16"] / rps["sidecar"]["c16"], 3), ">=", TARGET_DROP_IN_VS_ENVELOPE
        )
        targets_35["drop_in_added_p50_c1_ms"] = _target(
            added["proxy"]["c1"]["p50"], "<=", added["sidecar"]["c1"]["p50"]
        )
    if idle:
        targets_35["rss_after_first_call_mib"] = _target(
            round(idle["VmRSS"] / 1024, 1), "<=", TARGET_RSS_MIB_35
        )
    return {
        "rps": rps,
        "ratios": ratios,
        "added_latency_ms": added,
        "cpu_us_per_call": cpu,
        "peak_rss_mib": peak_mib,
        "soak": soak_summary,
        "features": features,
        "targets": targets,
        "targets_35": targets_35,
    }


def table(results: dict[str, Any]) -> str:
    """The short table: the numbers docs/performance.md quotes."""
    s, main = results["summary"], results["main"]
    lines = [
        f"loop: {results['loop']}   commit: {results['meta']['commit']}   "
        f"runs of {results['meta']['duration_s']:.0f} s",
        "",
        f"{'':13s}{'req/s c16':>10s}{'req/s c64':>10s}{'p50 c1':>9s}{'p99 c1':>9s}"
        f"{'p50 c16':>9s}{'p99 c16':>9s}{'CPU/call':>10s}",
    ]
    for name in _present(main, ("direct", "passthrough", "sidecar", "proxy")):
        c1, c16, c64 = (_run(main, name, c) for c in (1, 16, 64))
        cpu = c16["cpu_us_per_call"].get("sidecar" if name == "proxy" else name)
        lines.append(
            f"{name:13s}{c16['rps']:10.0f}{c64['rps']:10.0f}"
            f"{c1['latency_us']['p50'] / 1000:9.3f}{c1['latency_us']['p99'] / 1000:9.3f}"
            f"{c16['latency_us']['p50'] / 1000:9.3f}{c16['latency_us']['p99'] / 1000:9.3f}"
            + (f"{cpu:8.0f}us" if cpu is not None else f"{'-':>10s}")
        )
    r, a = s["ratios"], s["added_latency_ms"]
    lines += [
        "(latencies in ms; direct = wrk to the upstream itself; sidecar = the envelope route "
        "POST /v1/calls; proxy = the drop-in route /proxy/openai/...)",
        "",
        f"sidecar / pass-through req/s: c16 {r['sidecar_vs_passthrough']['c16']:.2f}x  "
        f"c64 {r['sidecar_vs_passthrough']['c64']:.2f}x   (pass-through / direct: "
        f"c16 {r['passthrough_vs_direct']['c16']:.2f}x, sidecar / direct: "
        f"c16 {r['sidecar_vs_direct']['c16']:.2f}x)",
        f"added latency vs direct (ms): sidecar c1 p50 {a['sidecar']['c1']['p50']:.3f} "
        f"p99 {a['sidecar']['c1']['p99']:.3f}, c16 p50 {a['sidecar']['c16']['p50']:.3f} "
        f"p99 {a['sidecar']['c16']['p99']:.3f}; pass-through c1 p50 "
        f"{a['passthrough']['c1']['p50']:.3f} p99 {a['passthrough']['c1']['p99']:.3f}",
        f"sidecar peak RSS (VmHWM) after the main runs: {s['peak_rss_mib']:.1f} MiB",
    ]
    if "proxy_vs_passthrough" in r:
        lines.insert(
            -1,
            f"proxy route / pass-through req/s: c16 {r['proxy_vs_passthrough']['c16']:.2f}x; "
            f"added latency c1 p50 {a['proxy']['c1']['p50']:.3f} ms "
            f"(target >= {TARGET_PROXY_RATIO}x)",
        )
    if s["soak"]:
        k = s["soak"]
        lines.append(
            f"soak: RSS {k['rss_first_mib']:.1f} MiB after {k['calls_first']:,} calls, "
            f"{k['rss_last_mib']:.1f} MiB after {k['calls_last']:,} ({k['growth_mib']:+.1f} MiB; "
            f"peak {k['hwm_mib']:.1f} MiB; {k['stopped']})"
        )
    if s["features"]:
        lines += ["", f"{'feature variant':17s}{'req/s c16':>10s}{'CPU/call':>10s}"
                  f"{'saved':>8s}{'+p50 ms':>9s}{'+p99 ms':>9s}  what is off",
                  "(each row one run of a fresh sidecar: on a shared VM a difference under "
                  "~15% of CPU/call is noise; bench/instructions.py counts what holds)",
                  ]  # fmt: skip
        for f in s["features"]:
            saved = f"{f['cpu_saved_us']:+6.0f}us" if f["cpu_saved_us"] is not None else "      - "
            lines.append(
                f"{f['variant']:17s}{f['rps_c16']:10.0f}{f['cpu_us_per_call'] or 0:8.0f}us{saved}"
                f"{f['added_p50_ms_c1']:9.3f}{f['added_p99_ms_c1']:9.3f}  {f['off']}"
            )
    lines += ["", "targets (issue 21; stream targets: bench/stream.py):"]
    lines += _target_lines(s["targets"])
    if s.get("targets_35"):
        lines += [
            "targets (issue 35; streams: bench/streams.py, the controls' cost: "
            "bench/instructions.py):"
        ]
        lines += _target_lines(s["targets_35"])
    return "\n".join(lines)


def _target_lines(targets: dict[str, Any]) -> list[str]:
    return [
        f"  {'MET ' if t['met'] else 'MISS'} {name:24s} {t['value']!s:>8s}  ({t['target']})"
        for name, t in targets.items()
    ]
