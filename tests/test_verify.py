"""One small verification on this machine: SmolLM2 on CPU, 30 requests, engine against simulator.

The profile is made first, here and now (a short sweep), with the engine on one thread: a step that
waits for two threads on a 2-core VM runs 3-4x slower, and erratically, as soon as anything else uses a
core, while a one-thread engine keeps its pace. Whatever drift is left, the verification measures between
the served steps and takes out of the gated figures. The accuracy targets are `bench/verify_suite.py`'s."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import REPO, run_cli


def planner_json(args: list[str]) -> dict:
    """`planner ARGS --json` in a process of its own: its one JSON object (it must exit 0)."""
    result = subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=REPO,
                            timeout=900)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_small_verification_against_the_engine(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    made = run_cli("profile", "--model", "smollm2-135m", "--device", "cpu", "--kv-dtype", "bf16", "--memory-gib", "1",
                   "--threads", "1",
                   "--prefill-tokens", "16", "64", "128", "256", "512", "1024",
                   "--batches", "1", "2", "4", "8", "12", "16", "24", "32",       # the workload peaks at ~30
                   "--contexts", "64", "128", "256", "512", "--repeats", "2", "--out", str(profile), "--json",
                   "--speculative", "ngram:4",      # verification points too, for the speculative verification
                   timeout=900)      # ~2.5 min on an idle 2-core VM, 5 beside two busy processes
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["samples"] > 40          # --json: one JSON object on stdout, the points on stderr
    args = ["verify", "--profile", str(profile), "--workload", "poisson", "--rate", "4", "--requests", "30",
            "--prompt-tokens", "uniform:32:256", "--output-tokens", "uniform:16:48", "--kv-cache-gib", "0.1",
            "--seed", "1", "--out-dir", str(tmp_path), "--json"]
    payload = planner_json(args)
    metrics = payload["metrics"]
    with capsys.disabled():
        print("\nverification errors: " + ", ".join(f"{k} {m['error_pct']}%" for k, m in metrics.items()))
        print("step model on the engine's steps: " + json.dumps(payload["replay"]["step_model"]))
        print("the same at the machine's speed then: " + json.dumps(payload["replay"]["step_model_drift_corrected"]))
        machine = payload["machine"]
        print(f"machine vs profile: {machine['slowdown_vs_profile_pct']}% slower (CPU steal "
              f"{machine['cpu_steal_pct']}%); drift-corrected errors: "
              + ", ".join(f"{k} {m['error_pct']}%" for k, m in machine["metrics_drift_corrected"].items()))
    assert metrics["kv_capacity_tokens"]["error_pct"] == 0 and metrics["kv_capacity_tokens"]["measured"] > 0
    assert payload["replay"]["same_batches"]
    assert payload["replay"]["preemptions"]["predicted"] == payload["replay"]["preemptions"]["measured"]
    # Issue 8's 15%, as measured or on the predictions scaled by the machine's drift measured between the served
    # steps: a steady machine needs no correction, and the drift probes themselves are noisy (seen: -1.6% raw,
    # +19.6% "corrected" for a drift of -17.7% the served steps did not show)
    for figure in ("output_tokens_per_s", "tpot_p50_s"):
        errors = (metrics[figure]["error_pct"], machine["metrics_drift_corrected"][figure]["error_pct"])
        assert min(map(abs, errors)) < 15, (figure, errors)
    assert abs(machine["slowdown_vs_profile_pct"]) < 50 and len(machine["probes"]) == 5
    assert 0 <= machine["cpu_steal_pct"] <= 100            # Linux's /proc/stat, read around the served run
    assert payload["fingerprint"]["threads"] == 1 and all(probe["timed"] >= 3 for probe in machine["probes"])
    assert {"workload", "fingerprint", "machine"} <= set(payload)
    assert (tmp_path / "report.md").read_text().startswith("# Verification: smollm2-135m")
    assert "plotly" in (tmp_path / "figure.html").read_text()
    verify_conversations(profile, capsys)
    verify_disaggregated(profile, capsys)
    verify_speculative(profile, capsys)


def verify_conversations(profile, capsys) -> None:
    """Issue 32's verification: conversations of four turns opening with a shared system prompt. The engine and
    the simulator run the same block manager, so every request finds as many tokens cached in both; TTFT p50 and
    output tokens/s within 15% (as measured or drift-corrected, as above)."""
    args = ["verify", "--profile", str(profile), "--workload", "poisson", "--rate", "2", "--requests", "24",
            "--turns", "4", "--shared-prefix", "64", "--think-time", "0.5", "--prompt-tokens", "uniform:32:96",
            "--output-tokens", "uniform:16:32", "--kv-cache-gib", "0.1", "--seed", "1", "--json"]
    payload = planner_json(args)
    metrics, corrected = payload["metrics"], payload["machine"]["metrics_drift_corrected"]
    with capsys.disabled():
        print("\nconversations: " + ", ".join(f"{k} {m['error_pct']}%" for k, m in metrics.items())
              + "; drift-corrected: " + ", ".join(f"{k} {m['error_pct']}%" for k, m in corrected.items()))
    assert payload["replay"]["cached_tokens_equal"] and payload["replay"]["cached_tokens_equal_replayed"]
    assert metrics["cached_tokens"]["measured"] > 24 * 32 and metrics["cached_tokens"]["error_pct"] == 0
    assert payload["replay"]["same_batches"]
    for figure in ("output_tokens_per_s", "ttft_p50_s"):
        errors = (metrics[figure]["error_pct"], corrected[figure]["error_pct"])
        assert min(map(abs, errors)) < 15, (figure, errors)


def verify_speculative(profile, capsys) -> None:
    """Issue 34's verification: prompt-lookup drafts over prompts that repeat themselves. The profile has verification
    points (`--speculative ngram:4`), which price a step's verifications; the simulator draws each request's drafts
    and acceptance as the engine's steps show them for that request, and its replay of the engine's own step times
    replays the engine's drafts and what stood of them, so it forms the same batches. Output tokens/s and TPOT p50
    within 15% (as measured or drift-corrected)."""
    args = ["verify", "--profile", str(profile), "--workload", "poisson", "--rate", "4", "--requests", "24",
            "--prompt-tokens", "uniform:32:256", "--output-tokens", "uniform:16:48", "--kv-cache-gib", "0.1",
            "--seed", "1", "--speculative", "ngram:4", "--out-dir", str(Path(profile).parent / "speculative"),
            "--json"]
    payload = planner_json(args)
    metrics, corrected = payload["metrics"], payload["machine"]["metrics_drift_corrected"]
    drafted = json.loads((Path(profile).parent / "speculative" / "verification.json").read_text())["speculative"]
    with capsys.disabled():
        print(f"\nspeculative ({drafted['planner']}): " + ", ".join(f"{k} {m['error_pct']}%" for k, m in metrics.items())
              + "; drift-corrected: " + ", ".join(f"{k} {m['error_pct']}%" for k, m in corrected.items())
              + f"; step model on the engine's steps: {payload['replay']['step_model']}")
    assert drafted["engine"]["accepted_tokens"] > 0 and drafted["expected_tokens_per_step"] > 1.5
    assert payload["replay"]["same_batches"]
    for figure in ("output_tokens_per_s", "tpot_p50_s"):
        errors = (metrics[figure]["error_pct"], corrected[figure]["error_pct"])
        assert min(map(abs, errors)) < 15, (figure, errors)


def test_cpu_steal_share_between_two_readings():
    from planner.verification.verify import cpu_ticks, steal_pct

    assert steal_pct((100, 1000), (130, 1600)) == 5.0
    assert steal_pct(None, (130, 1600)) is None and steal_pct((100, 1000), (100, 1000)) is None
    stolen, total = cpu_ticks()
    assert 0 <= stolen <= total


def _decode_probe(num_decodes: int, median_s: float) -> dict:
    return {"kind": "decode", "batch": {"num_decodes": num_decodes}, "median_s": median_s}


def test_drift_is_taken_from_the_probes_nearest_each_served_step():
    """A minute of a slow machine (ratios 2) between fast ones (1): the steps served in it are scaled by 2,
    the others by 1, and one slow probe among fast ones moves nothing (the median of the nearest four)."""
    from planner.verification.verify import DriftProbes

    probes = DriftProbes(profiler=None, samples=[_decode_probe(1, 1.0), _decode_probe(1, 2.0)], every=1)
    probes.timeline = [(step, 0, 1.0) for step in range(10)] + [(step, 1, 4.0) for step in range(10, 20)]
    probes.timeline += [(step, 0, 1.0) for step in range(20, 30)] + [(5, 0, 3.0)]
    speeds = probes.local_speeds([("decode", 1)] * 30)
    assert speeds[:9] == [1.0] * 9 and speeds[12:18] == [2.0] * 6 and speeds[22:] == [1.0] * 8
    assert DriftProbes(profiler=None, samples=[]).local_speeds([("decode", 1)] * 3) == [1.0, 1.0, 1.0]


def test_drift_of_each_step_follows_the_probe_most_like_it():
    """The machine 10% slower for prefills and small decodes, 10% faster for big decodes, all run long: a step
    takes the factor of the probe of its own regime, decodes the one nearest in batch size."""
    from planner.verification.verify import DriftProbes

    samples = [{"kind": "prefill", "batch": {"num_decodes": 0}, "median_s": 1.0}, _decode_probe(1, 1.0),
               _decode_probe(32, 1.0)]
    probes = DriftProbes(profiler=None, samples=samples, every=1)
    probes.timeline = [(step, step % 3, 0.9 if step % 3 == 2 else 1.1) for step in range(60)]
    assert probes.probe_like("decode", 2) == 1 and probes.probe_like("decode", 20) == 2
    assert probes.probe_like("mixed", 3) is None
    speeds = probes.local_speeds([("prefill", 0), ("decode", 3), ("decode", 24), ("mixed", 4)])
    assert np.allclose(speeds, [1.1, 1.1, 0.9, 1.1])
    probes.timeline = probes.timeline[:15]          # five timings of each probe: too few for a shape factor
    assert np.allclose(probes.local_speeds([("prefill", 0), ("decode", 24)]), [1.1, 1.1])


def verify_disaggregated(profile: Path, capsys) -> None:
    """The same profile, a prefill engine and a decode engine with a small pool (about 110 pages: arrivals wait for
    pages) against the simulator's two pools: issue 35's 20% on TTFT and TPOT p50, hand-off bytes exact. At 2
    requests/s the prefill engine is busy about half the time; at 4 it is saturated, and its queue turns the step
    model's 5-7% on many-prompt prefills into -10 to -25% on TTFT."""
    args = ["verify", "--profile", str(profile), "--disaggregate", "--workload", "poisson", "--rate", "2",
            "--requests", "30", "--prompt-tokens", "uniform:32:256", "--output-tokens", "uniform:16:48",
            "--kv-cache-gib", "0.1", "--decode-kv-cache-gib", "0.04", "--seed", "2", "--json"]
    payload = planner_json(args)
    metrics = payload["metrics"]
    with capsys.disabled():
        print("\ndisaggregated verification errors: " + ", ".join(f"{k} {m['error_pct']}%" for k, m in metrics.items())
              + f"; hand-off costs {json.dumps(payload['handoff_costs'])}")
    assert payload["handoff_bytes_exact"] and metrics["handoff_bytes"]["measured"] > 0
    for figure in ("ttft_p50_s", "tpot_p50_s"):
        assert abs(metrics[figure]["error_pct"]) < 20, (figure, metrics[figure])
    assert payload["steps"]["prefill"] > 0 and payload["steps"]["decode"] > payload["steps"]["prefill"]
