"""The soak's verdict: what every request of a chaos soak got, counted and judged, and its table."""
from __future__ import annotations

import re
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.harness.soak import Soak

BAD_CASES = {                   # a malformed or over-limit request, and the status it must get
    "malformed_json": 400, "unknown_field": 400, "over_context": 400, "too_many_stops": 400,
    "token_out_of_vocab": 400, "n_above_one": 400, "body_too_large": 413, "wrong_model": 404,
    "wrong_key": 401, "missing_key": 401,
}
DRAIN_LINE = re.compile(r"drained: (?P<completed>\d+) of (?P<in_flight>\d+) requests completed, (?P<aborted>\d+) "
                        r"aborted, (?P<pages>\d+) KV pages in use")


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def judge(soak: Soak, idle: dict[str, float], shutdown: dict[str, Any]) -> dict[str, Any]:
    """Counts and verdicts from what every request got."""
    config = soak.config
    counts = {"requests": len(soak.outcomes), "exact": 0, "near_ties": 0, "lost": 0, "corrupted": 0, "hung_up": 0,
              "hung_up_prefix_ok": 0, "bad": 0, "bad_right_status": 0, "victims": 0, "victims_detected": 0,
              "victims_prefix_ok": 0, "harmed": 0}
    wrong_status: list[str] = []
    lost: list[str] = []            # what a lost request was told, to tell a harmed bystander's fault from a bug
    for index, outcome in soak.outcomes.items():
        item = soak.planned[index]
        if item.kind in BAD_CASES:
            counts["bad"] += 1
            if outcome.http_status == BAD_CASES[item.kind]:
                counts["bad_right_status"] += 1
            else:
                wrong_status.append(f"{item.kind}: {outcome.http_status}")
            continue
        reference = soak.references[item.chat, item.prompt][:item.max_tokens]
        prefix_ok = outcome.token_ids == reference[:len(outcome.token_ids)]         # exact: no near-tie forgiven
        response_id = f"{'chatcmpl' if item.chat else 'cmpl'}-{item.request_id}"
        if response_id in soak.victims:
            counts["victims"] += 1
            counts["victims_detected"] += outcome.status == "hung_up" or "integrity" in outcome.error
            counts["victims_prefix_ok"] += prefix_ok
        elif outcome.status == "hung_up":
            counts["hung_up"] += 1
            counts["hung_up_prefix_ok"] += prefix_ok
        elif outcome.status != "ok":
            counts["lost"] += 1
            counts["harmed"] += "integrity" in outcome.error
            lost.append(f"{response_id}: {outcome.status} {outcome.http_status} {outcome.error}")
        elif outcome.token_ids == reference:
            counts["exact"] += 1
        else:
            counts["near_ties" if len(outcome.token_ids) == len(reference)
                   and soak.ties(item, outcome.token_ids) is not None else "corrupted"] += 1
    ended = max((count for count, _ in soak.rss), default=0)
    half = [rss for count, rss in soak.rss if count >= ended // 2]
    growth_mib = (half[-1] - half[0]) / 2**20 if len(half) > 1 else 0.0
    ttfts = [o.ttft_s for i, o in soak.outcomes.items() if o.ttft_s is not None and soak.planned[i].kind == "good"]
    gaps = [gap for i, o in soak.outcomes.items() if soak.planned[i].kind == "good" for gap in o.gaps_s]
    report = {
        "config": asdict(config), "counts": counts, "wrong_status": wrong_status,
        "faults": soak.faults, "lost": lost, "pages_used_idle": idle["kvplan_kv_pages_used"],
        "pages_quarantined": idle["kvplan_kv_pages_quarantined"], "rss_start_mib": soak.rss[0][1] / 2**20,
        "rss_end_mib": soak.rss[-1][1] / 2**20, "rss_growth_second_half_mib": round(growth_mib, 1),
        "ttft_p50_s": _percentile(ttfts, 0.5), "ttft_p99_s": _percentile(ttfts, 0.99),
        "itl_p50_s": _percentile(gaps, 0.5), "itl_p99_s": _percentile(gaps, 0.99), "shutdown": shutdown,
    }
    failures = []
    for name in ("lost", "corrupted", "harmed"):
        if counts[name]:
            failures.append(f"{counts[name]} requests {name}")
    complete = counts["exact"] + counts["near_ties"] + counts["corrupted"]
    if counts["near_ties"] > config.near_tie_share_bound * complete:
        failures.append(f"{counts['near_ties']} of {complete} complete answers differ at near-ties (bound "
                        f"{config.near_tie_share_bound:.0%})")
    if counts["hung_up_prefix_ok"] != counts["hung_up"] or counts["victims_prefix_ok"] != counts["victims"]:
        failures.append("a cut-off stream received tokens that are not its greedy prefix")
    if wrong_status:
        failures.append(f"{len(wrong_status)} bad requests got the wrong status")
    if len(soak.faults) < config.faults or counts["victims_detected"] != counts["victims"]:
        failures.append(f"{len(soak.faults)} of {config.faults} faults injected, {counts['victims_detected']} of "
                        f"{counts['victims']} victims detected")
    if report["pages_used_idle"]:
        failures.append(f"{report['pages_used_idle']:g} KV pages held on the idle server")
    if growth_mib > config.rss_growth_bound_mib:
        failures.append(f"resident memory grew {growth_mib:.1f} MiB over the second half (bound "
                        f"{config.rss_growth_bound_mib:g})")
    drained = DRAIN_LINE.search(shutdown["drain_line"])
    if shutdown["exit_code"] != 0 or set(shutdown["probe_statuses"]) != {503} or shutdown[
            "probes_with_retry_after"] != len(shutdown["probe_statuses"]) or drained is None or int(
            drained["completed"]) != int(drained["in_flight"]) or drained["aborted"] != "0" or drained["pages"] != "0":
        failures.append(f"the shutdown: {shutdown}")
    report["failures"] = failures
    return report


def _seconds(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"      # none timed: every streamed request went wrong


TABLE_ROWS = (
    ("requests", lambda r: r["counts"]["requests"]),
    ("well-formed, exact greedy tokens", lambda r: r["counts"]["exact"]),
    ("... or greedy but for near-ties (bound)", lambda r: f"{r['counts']['near_ties']} "
                                                          f"({r['config']['near_tie_share_bound']:.0%})"),
    ("lost / corrupted", lambda r: f"{r['counts']['lost']} / {r['counts']['corrupted']}"),
    ("hung up mid-stream (prefix ok)", lambda r: f"{r['counts']['hung_up']} ({r['counts']['hung_up_prefix_ok']})"),
    ("bad requests (right status)", lambda r: f"{r['counts']['bad']} ({r['counts']['bad_right_status']})"),
    ("faults injected / victims (detected)", lambda r: f"{len(r['faults'])} / {r['counts']['victims']} "
                                                       f"({r['counts']['victims_detected']})"),
    ("other requests harmed", lambda r: r["counts"]["harmed"]),
    ("faults (kind: victims)", lambda r: ", ".join(f"{f['kind']}: {len(f['victims'])}" for f in r["faults"])),
    ("lost requests, first 3 (what they got)", lambda r: "; ".join(r["lost"][:3]) or "-"),
    ("KV pages held when idle (quarantined)", lambda r: f"{r['pages_used_idle']:g} ({r['pages_quarantined']:g})"),
    ("RSS start -> end (MiB)", lambda r: f"{r['rss_start_mib']:.0f} -> {r['rss_end_mib']:.0f}"),
    ("RSS growth, second half (MiB)", lambda r: f"{r['rss_growth_second_half_mib']} (bound "
                                                f"{r['config']['rss_growth_bound_mib']:g})"),
    ("TTFT p50 / p99 (s)", lambda r: f"{_seconds(r['ttft_p50_s'], 3)} / {_seconds(r['ttft_p99_s'], 3)}"),
    ("ITL p50 / p99 (s)", lambda r: f"{_seconds(r['itl_p50_s'], 4)} / {_seconds(r['itl_p99_s'], 4)}"),
    ("SIGTERM: last wave, 503 probes, exit", lambda r: f"{r['shutdown']['drain_line'].removeprefix('engine: ')}; "
                                                       f"{r['shutdown']['probe_statuses']}; "
                                                       f"exit {r['shutdown']['exit_code']}"),
    ("seconds: references, chaos, last wave", lambda r: ", ".join(str(v) for v in r["seconds"].values())),
)


def table(report: dict[str, Any]) -> str:
    width = max(len(name) for name, _ in TABLE_ROWS)
    lines = [f"{name:<{width}}  {value(report)}" for name, value in TABLE_ROWS]
    lines.append(f"{'verdict':<{width}}  {'PASS' if not report['failures'] else 'FAIL: ' + '; '.join(report['failures'])}")
    return "\n".join(lines)

