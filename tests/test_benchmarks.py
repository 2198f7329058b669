"""Serving benchmark files -> measured points -> a GPU calibration, cross-validated, with error bars."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.benchmarks.fit import (
    FREE,
    PointSetup,
    calibrate_benchmarks,
    cross_validate,
    fit_points,
    initial_parameters,
    point_deployment,
    point_workload,
    predictions,
    replay,
)
from planner.benchmarks.formats import BenchmarkPoint, Measurement, PointDefaults, read_benchmarks
from planner.calibration.parameters import PUBLIC_BENCHMARKS, load_calibration
from planner.cost.step_model import StepParameters, combine, step_terms
from planner.deployment.capacity import Deployment, evaluate
from planner.errors import PlannerError
from planner.simulation.simulator import BatchWait, Simulation, model_step_time

DATA = Path(__file__).resolve().parent / "data" / "benchmarks"
REPO = Path(__file__).resolve().parent.parent
H100 = PointDefaults(hardware="h100-sxm", gpus=1, weights="bf16", kv_dtype="bf16")
TRUTH = replace(initial_parameters(), step_overhead_s=8e-4, seq_overhead_s=2e-5, bandwidth_efficiency=0.7,
                gemv_efficiency=0.7, compute_efficiency=0.45, expert_overhead_s=1e-5, collective_latency_s=1.5e-5,
                request_overhead_s=0.05, expert_gemm_scale=0.4)


def planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO)


def test_vllm_save_result_json():
    (point,) = read_benchmarks([DATA / "vllm_serve.json"], H100)
    assert (point.model, point.hardware, point.gpus, point.engine) == ("llama-3.1-8b", "h100-sxm", 1, "vllm")
    assert (point.input_tokens, point.output_tokens, point.concurrency, point.request_rate) == (1024, 128, 16, None)
    document = json.loads((DATA / "vllm_serve.json").read_text())
    measured = {m.metric: m for m in point.measurements}
    assert measured["tpot"] == Measurement("tpot", document["median_tpot_ms"] / 1000, "median")
    assert measured["ttft"].value == pytest.approx(document["median_ttft_ms"] / 1000)
    assert measured["output_tokens_per_s"].value == document["output_throughput"]


def test_old_vllm_benchmark_serving_json_is_open_loop():
    (point,) = read_benchmarks([DATA / "vllm_benchmark_serving_old.json"], H100)
    assert (point.concurrency, point.request_rate) == (None, 2.0)
    assert point.input_tokens == 1024 and point.output_tokens == 128


def test_sglang_jsonl_lines_and_server_info():
    points = read_benchmarks([DATA / "sglang_bench_serving.jsonl"], replace(H100, gpus=1))
    assert [p.concurrency for p in points] == [1, 8]
    assert {p.engine for p in points} == {"sglang"} and {p.tensor_parallel for p in points} == {1}
    lines = [json.loads(line) for line in (DATA / "sglang_bench_serving.jsonl").read_text().splitlines()]
    assert [p.measured("itl").value for p in points] == [line["median_itl_ms"] / 1000 for line in lines]


def test_guidellm_report_strategies():
    synchronous, concurrent = read_benchmarks([DATA / "guidellm_report.json"], H100)
    assert (synchronous.concurrency, concurrent.concurrency) == (1, 8)
    report = json.loads((DATA / "guidellm_report.json").read_text())
    itl = report["benchmarks"][1]["metrics"]["inter_token_latency_ms"]["successful"]["median"]
    assert concurrent.measured("tpot") == Measurement("tpot", itl / 1000, "median")     # guidellm's ITL is TPOT
    assert synchronous.model == "llama-3.1-8b"


def test_csv_totals_all_at_once_and_stated_limits(tmp_path):
    path = tmp_path / "points.csv"
    path.write_text("model,hardware,gpus,weights,kv_dtype,total_input_tokens,total_output_tokens,num_prompts,"
                    "request_rate,tpot_ms,tpot_stat,output_tokens_per_s,source,attention_data_parallel,max_num_seqs,"
                    "max_num_batched_tokens\n"
                    "qwen3-8b,h100-sxm,2,bf16,bf16,40960,6400,50,inf,20.5,mean,900,https://example.org/run,true,32,"
                    "1024\n")
    (point,) = read_benchmarks([path])
    assert (point.input_tokens, point.output_tokens, point.concurrency, point.request_rate) == (819, 128, 50, None)
    assert point.measurements == (Measurement("tpot", 0.0205, "mean"), Measurement("output_tokens_per_s", 900.0))
    deployment = point_deployment(point)
    assert (deployment.attention_data_parallel, deployment.max_num_seqs, deployment.max_num_batched_tokens) == (
        True, 32, 1024)
    assert PointSetup.of(point).replicas == 2          # each GPU its own requests' KV


@pytest.mark.parametrize("content, suffix, message", [
    (None, ".json", "does not exist"),
    ("{not json", ".json", "neither JSON, JSONL nor CSV"),
    ('{"hello": 1}', ".json", "not a vLLM or SGLang serving benchmark result"),
    ("model,hardware,speed\nqwen3-8b,h100-sxm,3\n", ".csv", "unknown columns ['speed']"),
    ("model,hardware,gpus,weights,kv_dtype,input_tokens,output_tokens,concurrency,tpot_ms,tpot_stat\n"
     "qwen3-8b,h100-sxm,one,bf16,bf16,10,10,1,5,mean\n", ".csv", "column gpus has 'one'"),
    ("model,hardware,gpus,weights,kv_dtype,input_tokens,output_tokens,concurrency,tpot_ms,tpot_stat\n"
     "qwen3-8b,h100-sxm,1,bf16,bf16,10,10,1,5,p90\n", ".csv", "points.csv:2: tpot is given as 'p90'"),
    ("model,hardware,gpus,weights,kv_dtype,input_tokens,output_tokens,tpot_ms,tpot_stat\n"
     "qwen3-8b,h100-sxm,1,bf16,bf16,10,10,5,mean\n", ".csv", "neither a concurrency nor a request rate"),
])
def test_bad_files_refused_in_one_line(tmp_path, content, suffix, message):
    path = tmp_path / f"points{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlannerError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_benchmarks([path], H100)
    done = planner("calibrate", "--benchmark", str(path), "--hardware", "h100-sxm", "--gpus", "1", "--weights", "bf16",
                   "--kv", "bf16", "--out", str(tmp_path / "out.json"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def test_a_file_without_its_gpu_needs_the_flag(tmp_path):
    with pytest.raises(PlannerError, match="does not say its hardware.*--hardware"):
        read_benchmarks([DATA / "vllm_serve.json"], replace(H100, hardware=None))


def test_a_point_that_cannot_fit_its_gpus_is_refused(tmp_path):
    point = BenchmarkPoint(model="deepseek-v3", hardware="h100-sxm", gpus=1, weights="fp8", kv_dtype="bf16",
                           input_tokens=1024, output_tokens=128, measurements=(Measurement("output_tokens_per_s", 9.0),),
                           concurrency=1, label="dsv3.csv:2")
    with pytest.raises(PlannerError, match="dsv3.csv:2: .*does not fit on 1 x h100-sxm"):
        PointSetup.of(point)


def synthetic_points(specs, params=TRUTH, metrics=("tpot", "ttft", "output_tokens_per_s")) -> list[BenchmarkPoint]:
    """Points whose 'measurements' are the simulator's own answer at `params`."""
    points = [BenchmarkPoint(model=model, hardware=hardware, gpus=gpus, weights=weights, kv_dtype="bf16",
                             input_tokens=512, output_tokens=48, tensor_parallel=gpus, concurrency=users,
                             measurements=tuple(Measurement(m, 1.0, "total" if m == "output_tokens_per_s"
                                                            else "median") for m in metrics),
                             label=f"{model}-c{users}")
              for model, hardware, gpus, weights in specs for users in (1, 8, 48)]
    truth = predictions([PointSetup.of(point) for point in points], params)
    return [replace(point, measurements=tuple(replace(m, value=values[m.metric]) for m in point.measurements))
            for point, values in zip(points, truth)]


SPECS = [("llama-3.1-8b", "h100-sxm", 1, "bf16"), ("llama-3.1-70b", "h100-sxm", 4, "fp8"),
         ("deepseek-v3", "h200", 8, "fp8"), ("qwen3-30b-a3b", "h100-sxm", 1, "bf16")]


def test_synthetic_truth_recovered_within_5_percent():
    points = synthetic_points(SPECS)
    params, _ = fit_points([PointSetup.of(point) for point in points])
    for name in FREE:
        assert getattr(params, name) == pytest.approx(getattr(TRUTH, name), rel=0.05), name


def test_leave_one_model_out_predicts_each_model_from_the_others():
    """Model B's 'measurements' are twice the truth: a fit on A alone predicts B at about -50% (not exactly: the
    fold refits on the joint fit's schedules); the fit on both cannot."""
    dense = [("llama-3.1-8b", "h100-sxm", 1, "bf16"), ("qwen3-8b", "h100-sxm", 1, "bf16")]
    points = synthetic_points(dense)
    points = [replace(p, measurements=tuple(replace(m, value=2 * m.value) for m in p.measurements))
              if p.model == "qwen3-8b" else p for p in points]
    setups = [PointSetup.of(point) for point in points]
    params, replays = fit_points(setups, start=TRUTH)
    kind, rows = cross_validate(setups, params, replays)
    assert kind == "leave-one-model-out"
    assert len(rows) == sum(len(p.measurements) for p in points)
    held_b = [row["error_pct"] for row in rows if row["model"] == "qwen3-8b"]
    assert held_b == pytest.approx([-50.0] * len(held_b), abs=3.0)
    joint = [abs(v / m.value - 1) for point, values in zip(points[3:], predictions(setups[3:], params))
             for m, v in zip(point.measurements, values.values())]
    assert sum(joint) / len(joint) < sum(abs(e) for e in held_b) / 100 / len(held_b)


def test_a_fit_above_the_cross_validated_threshold_is_refused():
    dense = [("llama-3.1-8b", "h100-sxm", 1, "bf16"), ("qwen3-8b", "h100-sxm", 1, "bf16")]
    points = [replace(p, measurements=tuple(replace(m, value=3 * m.value) for m in p.measurements))
              if p.model == "qwen3-8b" else p for p in synthetic_points(dense, metrics=("tpot", "output_tokens_per_s"))]
    with pytest.raises(PlannerError, match=r"leave-one-model-out median error is .*% \(tpot\), above the 10% "):
        calibrate_benchmarks(points, max_cv_median_pct=10)


def test_replay_reprices_its_schedule_exactly_at_its_own_parameters():
    (point,) = [p for p in synthetic_points(SPECS[2:3]) if p.concurrency == 8]
    setup = PointSetup.of(point)
    recorded = replay(setup, TRUTH)
    assert recorded.predict(TRUTH) == pytest.approx({m.metric: m.value for m in point.measurements}, rel=1e-9)
    slower = replace(TRUTH, step_overhead_s=2 * TRUTH.step_overhead_s)
    assert recorded.predict(slower)["tpot"] > recorded.predict(TRUTH)["tpot"]


def test_cli_calibrates_from_benchmark_files_and_plan_takes_it(tmp_path):
    out = tmp_path / "fit.json"
    files = [str(DATA / name) for name in ("vllm_serve.json", "sglang_bench_serving.jsonl", "guidellm_report.json")]
    done = planner("calibrate", "--benchmark", *files, "--hardware", "h100-sxm", "--gpus", "1", "--weights", "bf16",
                   "--kv", "bf16", "--max-cv-error", "500", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["num_points"] == 5 and document["cross_validation"] == "leave-one-point-out"
    assert {row["metric"] for row in document["rows"]} >= {"tpot", "ttft", "output_tokens_per_s"}
    assert not {"collective_latency_s", "expert_overhead_s", "expert_gemm_scale"} & set(document["free_parameters"])
    plan = planner("plan", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--gpus", "1", "--weights", "bf16",
                   "--kv", "bf16", "--calibration", str(out), "--json")
    assert plan.returncode == 0, plan.stderr
    summary = json.loads(plan.stdout)
    bar = summary["uncertainty_pct"]["decode_tokens_per_s"]
    assert bar == document["uncertainty_pct"]["output_tokens_per_s"]
    assert summary["decode_tokens_per_s_low"] < summary["decode_tokens_per_s"] < summary["decode_tokens_per_s_high"]
    refused = planner("plan", "--model", "llama-3.1-8b", "--hardware", "b200", "--gpus", "1", "--weights", "bf16",
                      "--kv", "bf16", "--calibration", str(out))
    assert refused.returncode == 2 and "was made on h100-sxm, not 'b200'" in refused.stderr


def test_profile_calibrations_never_fit_the_benchmark_only_terms():
    for path in sorted((REPO / "planner" / "profiles").glob("cpu-*.calibration.json")):
        params = load_calibration(path).parameters
        assert params.request_overhead_s == 0 and params.expert_gemm_scale == 1, path.name
    assert StepParameters().request_overhead_s == 0 and StepParameters().expert_gemm_scale == 1


def test_committed_public_calibration_is_the_default_with_error_bars():
    calibration = load_calibration(PUBLIC_BENCHMARKS)
    document = calibration.document
    assert {"h100-sxm", "h200"} <= set(calibration.hardware_kinds)
    assert document["num_points"] >= 40 and len(document["models"]) >= 4
    assert not [m for m in document["models"] if m.startswith(("kimi", "glm"))]
    assert document["held_out_rows"] and {row["model"] for row in document["held_out_rows"]} <= {"kimi-k2.6", "glm-5.2"}
    costed = evaluate(Deployment("deepseek-v3", "h200", 8, weights="fp8", kv_dtype="fp8"))
    assert costed.parameters_source.startswith(f"calibrated on {document['num_points']} public measurements")
    summary = costed.summary()
    assert summary["uncertainty_pct"]["single_stream_decode_tokens_per_s"] == document["uncertainty_pct"]["single_stream"]
    assert (summary["single_stream_decode_tokens_per_s_low"] < summary["single_stream_decode_tokens_per_s"]
            < summary["single_stream_decode_tokens_per_s_high"])
    uncalibrated = evaluate(Deployment("llama-3.1-8b", "l40s", 1, weights="bf16", kv_dtype="bf16"))
    assert uncalibrated.summary()["uncertainty_pct"] is None
    assert not [key for key in uncalibrated.summary() if key.endswith(("_low", "_high"))]
    assert "no error bar" in uncalibrated.parameters_source


def test_range_ratios_llmperf_latency_and_engine_defaults(tmp_path):
    """Lengths drawn over [ratio x L, L] (the nominal from a run's totals), LLMPerf's per-request E2E / output tokens
    predicted as such, and the engine's own batch limits where the row states none."""
    path = tmp_path / "points.csv"
    path.write_text("model,hardware,gpus,weights,kv_dtype,input_tokens,output_tokens,total_input_tokens,"
                    "total_output_tokens,num_prompts,concurrency,itl_ms,itl_stat,engine,length_range_ratio,source\n"
                    "qwen3-8b,h100-sxm,1,bf16,bf16,1000,200,,,,4,9.0,llmperf,trtllm,,https://example.org/a\n"
                    "qwen3-8b,h100-sxm,1,bf16,bf16,,,25000,5000,50,4,9.0,median,sglang,0.0,https://example.org/b\n"
                    "qwen3-8b,h100-sxm,1,bf16,bf16,1000,200,,,,4,9.0,mean,vllm,0.8,https://example.org/c\n")
    llmperf, sglang, vllm = read_benchmarks([path])
    assert llmperf.measurements == (Measurement("itl", 0.009, "llmperf"),)
    assert (sglang.input_tokens, sglang.output_tokens) == (1000, 200)       # twice the means: uniform over [1, L]
    prompt = point_workload(vllm).prompt
    assert (prompt.kind, prompt.low, prompt.high) == ("uniform", 800, 1000)
    assert point_workload(llmperf).prompt.kind == "fixed"
    assert [(point_deployment(p).max_num_seqs, point_deployment(p).max_num_batched_tokens)
            for p in (llmperf, sglang, vllm)] == [(2048, 8192), (2048, 8192), (1024, 8192)]
    setup = PointSetup.of(llmperf)
    params = replace(initial_parameters(), request_overhead_s=0.05)
    per_token = replay(setup, params).predict(params)["itl"]
    plain = replace(llmperf, measurements=(Measurement("itl", 0.009, "median"),))
    median_gap = replay(PointSetup.of(plain), params).predict(params)["itl"]
    assert per_token > median_gap * 1.01            # the TTFT spread over the output tokens raises it
    with pytest.raises(PlannerError, match="ttft is given as 'llmperf'"):
        Measurement("ttft", 0.1, "llmperf")


def test_a_run_of_num_prompts_and_a_scheduler_that_polls_every_n_steps():
    """A closed loop replays the run's own number of prompts (its first burst weighs as much as in the run); SGLang's
    `--scheduler-recv-interval 30` keeps arrivals out for up to 30 decode steps: a higher TTFT, no higher TPOT (what
    arrives in between is prefilled together), and the replay still re-prices to the simulator's own figures."""
    (point,) = [p for p in synthetic_points(SPECS[:1]) if p.concurrency == 8]
    assert point_workload(point).num_requests == 24                  # three requests a user where the run is unknown
    assert point_workload(replace(point, num_prompts=80)).num_requests == 80
    run = replace(point, num_prompts=80, length_range_ratio=0.5)    # lengths drawn: requests end apart
    polled = replace(run, scheduler_recv_interval=30)
    figures = {}
    for name, item in (("every step", run), ("every 30", polled)):
        setup = PointSetup.of(item)
        figures[name] = replay(setup, TRUTH).predict(TRUTH)
    assert figures["every 30"]["ttft"] > figures["every step"]["ttft"] + 5 * figures["every step"]["tpot"]
    assert figures["every 30"]["tpot"] <= figures["every step"]["tpot"]     # prompts batched: fewer decodes slowed
    setup = PointSetup.of(polled)
    step_time = model_step_time(lambda shape: combine(step_terms(setup.costs, shape), setup.peaks, TRUTH))
    direct = Simulation(setup.config, step_time, request_overhead_s=TRUTH.request_overhead_s, receive_interval=30,
                        record_steps=False).run(point_workload(polled))
    assert figures["every 30"]["ttft"] == pytest.approx(float(np.median([t.ttft_s for t in direct.timings])),
                                                        rel=1e-9)
    with pytest.raises(PlannerError, match="receive interval must be a positive number of steps, got 0"):
        replace(point, scheduler_recv_interval=0)


def test_batch_waiting_from_the_csv_holds_prompts_back_in_the_replay(tmp_path):
    """TensorRT-LLM's `batch_wait_timeout_iters: 20`, `batch_wait_max_tokens_ratio: 0.9` (the InferenceX Llama 1k/1k
    runs): prompts that arrive while others decode wait up to 20 steps for a fuller batch, so TTFT rises by steps,
    and the replay re-prices to the simulator's own figures. One column without the other, or a ratio out of range,
    is refused naming the row."""
    columns = ("model,hardware,gpus,weights,kv_dtype,input_tokens,output_tokens,concurrency,num_prompts,"
               "length_range_ratio,tpot_ms,tpot_stat,ttft_ms,ttft_stat,max_num_batched_tokens,batch_wait_timeout_iters,"
               "batch_wait_max_tokens_ratio\n")
    row = "qwen3-8b,h100-sxm,1,bf16,bf16,1024,256,16,64,0.8,9,median,80,median,16384"
    path = tmp_path / "points.csv"
    path.write_text(columns + row + ",,\n" + row + ",20,0.9\n")
    plain, waiting = read_benchmarks([path])
    assert (plain.batch_wait, waiting.batch_wait) == (None, BatchWait(20, 0.9))
    figures = {}
    for name, point in (("plain", plain), ("waiting", waiting)):
        figures[name] = replay(PointSetup.of(point), TRUTH).predict(TRUTH)
    assert figures["waiting"]["ttft"] > figures["plain"]["ttft"] + 5 * figures["plain"]["tpot"]
    setup = PointSetup.of(waiting)
    step_time = model_step_time(lambda shape: combine(step_terms(setup.costs, shape), setup.peaks, TRUTH))
    direct = Simulation(setup.config, step_time, request_overhead_s=TRUTH.request_overhead_s,
                        batch_wait=BatchWait(20, 0.9), record_steps=False).run(point_workload(waiting))
    assert figures["waiting"]["ttft"] == pytest.approx(float(np.median([t.ttft_s for t in direct.timings])),
                                                       rel=1e-9)
    for tail, message in ((",20,\n", "needs both batch_wait_timeout_iters and batch_wait_max_tokens_ratio, got 20 "
                                      "and None"),
                          (",20,1.5\n", r"points.csv:2: batch waiting's token ratio must be in \(0, 1\], got 1.5")):
        path.write_text(columns + row + tail)
        with pytest.raises(PlannerError, match=message):
            read_benchmarks([path])
