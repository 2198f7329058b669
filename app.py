"""kvplan dashboard: plan, compare, simulate, verify. Layout only; the numbers come from `planner`."""
from __future__ import annotations

import streamlit as st

from planner.catalog.engines import ENGINE_NAMES, ENGINES
from planner.catalog.hardware import hardware_names
from planner.catalog.models import model_names
from planner.cost.memory_plan import KV_DTYPES, WEIGHT_SCHEMES
from planner.deployment.capacity import Deployment
from planner.errors import PlannerError
from planner.search.deployments import WORKLOAD_PRESETS
from planner.simulation.workload import ARRIVALS, LengthDistribution, Workload
from planner.ui import dashboard

PAGES = ("Plan", "Compare", "Simulate", "Search", "Verify")
ENGINE_CHOICES = (None, *ENGINES)
GIB = float(1 << 30)

st.set_page_config(page_title="kvplan", layout="wide")


def deployment_inputs() -> Deployment | None:
    """The sidebar: model (preset or upload), hardware, GPUs, dtypes, context, price."""
    default = dashboard.DEFAULT
    sidebar = st.sidebar
    models = model_names()
    model = sidebar.selectbox("Model", models, index=models.index(default.model))
    upload = sidebar.file_uploader("or upload a config.json", type=["json"])
    if upload is not None:
        try:
            model = dashboard.model_from_upload(upload.getvalue())
            sidebar.caption(f"using the uploaded config ({upload.name})")
        except PlannerError as error:
            st.error(f"Uploaded config rejected: {error}")
            return None
    hardware = sidebar.selectbox("Hardware", hardware_names(), index=hardware_names().index(default.hardware))
    gpus = int(sidebar.number_input("GPUs", min_value=1, max_value=1024, value=default.gpus, step=1))
    weights = sidebar.selectbox("Weights", WEIGHT_SCHEMES, index=WEIGHT_SCHEMES.index(default.weights))
    kv = sidebar.selectbox("KV cache", KV_DTYPES, index=KV_DTYPES.index(default.kv_dtype))
    context = int(sidebar.number_input("Context per request (tokens)", min_value=1, value=default.context, step=1024))
    price = sidebar.number_input("USD per GPU-hour (0 = catalogue)", min_value=0.0, value=0.0, step=0.25)
    caching = sidebar.checkbox("Prefix caching", value=default.prefix_caching)
    engine = sidebar.selectbox("Serving engine (its calibration)", ENGINE_CHOICES,
                               format_func=lambda name: ENGINE_NAMES.get(name, "every engine's fit"))
    return Deployment(model=model, hardware=hardware, gpus=gpus, weights=weights, kv_dtype=kv, context=context,
                      gpu_hour_usd=price or None, prefix_caching=caching, engine=engine)


def show_plan(deployment: Deployment) -> None:
    view = dashboard.plan_view(deployment)
    summary, details = view["summary"], view["details"]
    st.subheader(f"{deployment.model} on {deployment.gpus} x {deployment.hardware}")
    st.caption(f"Layout: {details['layout']}. Step times from {details['parameters_source']}.")
    bars = summary["uncertainty_pct"] or {}
    columns = st.columns(4)
    columns[0].metric("Max context (tokens)", f"{summary['max_context_tokens']:,}")
    columns[1].metric("Max concurrency", f"{summary['max_concurrency']:,}", help=f"at {deployment.context} tokens")
    barred(columns[2], "Decode (tok/s)", f"{summary['decode_tokens_per_s']:,.0f}", bars, "decode_tokens_per_s")
    barred(columns[3], "Prefill (tok/s)", f"{summary['prefill_tokens_per_s']:,.0f}", bars, "prefill_tokens_per_s")
    columns = st.columns(4)
    cost = summary["cost_per_million_tokens"]
    barred(columns[0], "Cost per 1M output tokens", "-" if cost is None else f"${cost:,.3f}", bars,
           "cost_per_million_tokens")
    columns[1].metric("Weights per GPU", f"{summary['weights_bytes_per_gpu'] / GIB:.1f} GiB")
    columns[2].metric("KV capacity (tokens)", f"{summary['kv_capacity_tokens']:,}")
    columns[3].metric("KV bytes per token per GPU", f"{summary['kv_bytes_per_token_per_gpu']:,}")
    st.plotly_chart(view["figure"], key="plan-memory")
    st.plotly_chart(view["concurrency"], key="plan-concurrency")
    st.caption(f"Max context limited by {details['max_context_reason']}."
               + ("" if bars else " Uncalibrated: no error bars."))
    for note in details["notes"]:
        st.warning(note)


def barred(column, label: str, value: str, bars: dict[str, float | None], figure: str) -> None:
    """A tile whose value stays whole: the figure, its error bar beneath it (the calibration's, where there is one)."""
    bar = bars.get(figure)
    column.metric(label, value, delta=None if bar is None else f"±{bar:g}%", delta_color="off", delta_arrow="off",
                  help="cross-validated error bar of the calibration" if bar is not None else "no error bar: "
                  "uncalibrated defaults")


def show_compare(deployment: Deployment) -> None:
    view = dashboard.compare_view(deployment)
    kv, weights = view["kv"], view["weights"]
    st.subheader("BF16 against FP8 KV cache")
    st.dataframe([{"KV": name, **kv[name]} for name in ("bf16", "fp8")])
    st.write(f"FP8 KV: {kv['capacity_ratio']}x the context capacity, {kv['concurrency_ratio']}x the concurrency, "
             f"{kv['decode_throughput_ratio']}x the decode throughput at each one's largest concurrency.")
    st.subheader("FP8 against INT4 weights")
    st.dataframe([{"weights": name, **weights[name]} for name in ("fp8", "int4")])
    st.write(f"INT4: {weights['weight_bytes_ratio']}x the weight bytes, {weights['single_stream_speedup']}x the "
             f"single-stream decode speed, {weights['prefill_speedup']}x the prefill speed (compute-bound).")
    st.plotly_chart(view["figure"], key="compare-memory")
    integrity = view["integrity"]
    st.subheader("KV-cache integrity checks")
    if integrity is None:
        st.info("No integrity benchmark yet: run `bench/integrity.py --json`.")
    else:
        st.write(f"Ownership check: {integrity['check_share_ownership_pct']}% of the step time measured inside "
                 f"the check (end-to-end ratio {integrity['overhead_ownership_pct']}%, within timing noise); full "
                 f"checks (every sealed page checksummed): {integrity['overhead_full_pct']}%, sampled: "
                 f"{integrity['overhead_full_sampled_pct']}%. Fault campaign: {integrity['faults_detected']} of "
                 f"{integrity['faults_injected']} faults detected, {integrity['requests_harmed']} requests harmed.")


def show_simulate(deployment: Deployment) -> None:
    base = dashboard.default_workload()
    columns = st.columns(4)
    arrival = columns[0].selectbox("Arrivals", [a for a in ARRIVALS if a != "trace"])
    rate = columns[1].number_input("Rate (requests/s)", min_value=0.01, value=base.rate, step=0.5)
    users = int(columns[1].number_input("Users (closed loop)", min_value=1, value=64, step=1))
    requests = int(columns[2].number_input("Requests", min_value=1, max_value=20000, value=base.num_requests))
    prompt = int(columns[2].number_input("Prompt tokens", min_value=1, value=base.prompt.value, step=128))
    output = int(columns[3].number_input("Output tokens", min_value=1, value=base.output.value, step=64))
    slo_ttft = columns[3].number_input("TTFT p99 SLO (s)", min_value=0.0, value=2.0, step=0.5)
    slo_tpot = columns[3].number_input("TPOT p99 SLO (s)", min_value=0.0, value=0.1, step=0.01)
    columns = st.columns(4)
    shared = int(columns[0].number_input("Shared system prompt (tokens)", min_value=0, value=0, step=256))
    turns = int(columns[1].number_input("Turns per conversation", min_value=1, value=1, step=1))
    think = columns[2].number_input("Think time between turns (s)", min_value=0.0, value=0.0, step=1.0)
    workload = Workload(arrival, requests, rate=rate, users=users if arrival == "closed" else None,
                        prompt=LengthDistribution("fixed", prompt), output=LengthDistribution("fixed", output),
                        shared_prefix_tokens=shared, turns=turns, think_time_s=think)
    view = dashboard.simulate_view(deployment, workload, slo_ttft or None, slo_tpot or None, [1, 8, 32, 64, 128, 256])
    report = view["report"]
    columns = st.columns(4)
    bars = view["uncertainty_pct"] or {}
    barred(columns[0], "TTFT p99", f"{report['ttft_p99_s']:.3f} s", bars, "ttft_p99_s")
    barred(columns[1], "TPOT p99", "-" if report["tpot_p99_s"] is None else f"{report['tpot_p99_s']:.4f} s", bars,
           "tpot_p99_s")
    barred(columns[2], "Output throughput", f"{report['output_tokens_per_s']:,.0f} tok/s", bars,
           "output_tokens_per_s")
    columns[3].metric("Preemptions", report["preemptions"])
    st.metric("Prefix-cache hit rate", f"{report['prefix_cache_hit_rate']:.0%}"
              + ("" if deployment.prefix_caching else " (caching off)"))
    st.plotly_chart(view["latency"], key="sim-latency")
    st.plotly_chart(view["kv"], key="sim-kv")
    st.plotly_chart(view["curve"], key="sim-curve")
    if deployment.prefix_caching:
        st.markdown("**Prefix caching**: the same load with a growing share of each prompt shared by all requests")
        st.plotly_chart(dashboard.prefix_cache_view(deployment, workload)["figure"], key="sim-prefix")


def show_search(deployment: Deployment) -> None:
    st.subheader(f"The cheapest way to serve {deployment.model} within the SLOs")
    columns = st.columns(4)
    ttft = columns[0].number_input("TTFT p99 SLO (s)", min_value=0.01, value=2.0, step=0.5)
    tpot = columns[0].number_input("TPOT p99 SLO (s)", min_value=0.001, value=0.05, step=0.01, format="%.3f")
    hardware = columns[1].multiselect("Hardware", hardware_names(), default=[deployment.hardware])
    max_gpus = int(columns[1].number_input("Max GPUs per replica", min_value=1, max_value=64,
                                           value=deployment.gpus, step=1))
    workload = columns[2].selectbox("Workload", list(WORKLOAD_PRESETS))
    requests = int(columns[2].number_input("Requests per simulation", min_value=20, max_value=2000, value=60))
    if not hardware:
        st.info("Choose at least one kind of GPU.")
        return
    view = dashboard.search_view(deployment, f"ttft_p99_s={ttft},tpot_p99_s={tpot}", hardware, max_gpus, workload,
                                 requests)
    columns[3].metric("Configurations", view["enumerated"], help=f"{view['pruned']} pruned analytically, "
                                                                   f"{view['simulated']} simulated")
    columns[3].metric("Meet the SLOs", view["met_slo"])
    if view["note"]:
        st.warning(view["note"])
        return
    st.plotly_chart(view["figure"], key="search-pareto")
    st.dataframe(view["ranked"])
    for item in view["deploy"]:
        st.markdown(f"**{item['configuration']}**")
        st.code(item["vllm"], language="bash")
        st.code(item["sglang"], language="bash")


def show_verify() -> None:
    source = st.radio("Verify", ("Saved reports", "A live endpoint"), horizontal=True)
    if source == "A live endpoint":
        show_live_verification()
        return
    reports = dashboard.verification_reports()
    if not reports:
        st.info("No verification report yet: run `planner verify --profile ... --out-dir bench/results` "
                "or `bench/verify_suite.py --json`.")
        return
    choice = st.selectbox("Report", [path.name for path in reports])
    try:
        runs = dashboard.load_verification(next(p for p in reports if p.name == choice))
    except (PlannerError, ValueError) as error:
        st.error(f"Cannot open {choice}: {error}")
        return
    names = [run.get("name") or f"run {i + 1}" for i, run in enumerate(runs)]
    result = runs[names.index(st.selectbox("Workload", names))] if len(runs) > 1 else runs[0]
    tables = dashboard.verification_tables(result)
    st.dataframe(tables["metrics"])
    if tables["slowdown_pct"] is not None:
        st.markdown(f"The machine ran the profile's own steps {tables['slowdown_pct']:+.1f}% slower than when "
                    "they were profiled. Errors with the predicted step times scaled by that:")
        st.dataframe(tables["drift_corrected"])
    from planner.ui.plots import predicted_vs_measured

    st.plotly_chart(predicted_vs_measured(result), key="verify-figure")


def show_live_verification() -> None:
    """A workload against a running OpenAI-compatible server (ours, vLLM, SGLang) and through the simulator
    calibrated on it (`planner calibrate --endpoint`)."""
    url = st.text_input("Endpoint", "http://127.0.0.1:8000")
    calibration = st.text_input("Its calibration (planner calibrate --endpoint ... --out FILE)", "")
    rate_column, requests_column, prompt_column, output_column = st.columns(4)
    rate = rate_column.number_input("Requests/s", min_value=0.01, value=1.0)
    requests = int(requests_column.number_input("Requests", min_value=1, value=20, step=1))
    prompt = int(prompt_column.number_input("Prompt tokens", min_value=1, value=128, step=16))
    output = int(output_column.number_input("Output tokens", min_value=1, value=32, step=8))
    if not st.button("Run the workload against the endpoint"):
        return
    if not calibration.strip():
        st.error("Give the endpoint's calibration: make one with `planner calibrate --endpoint URL --model M "
                 "--hardware H --out FILE`")
        return
    from planner.endpoint.verify import verify_endpoint
    from planner.ui.plots import predicted_vs_measured

    workload = Workload("poisson", requests, rate=rate, prompt=LengthDistribution("fixed", prompt),
                        output=LengthDistribution("fixed", output))
    with st.spinner(f"{requests} requests against {url}"):
        result = verify_endpoint(url, calibration.strip(), workload)
    st.dataframe(dashboard.verification_tables(result)["metrics"])
    st.plotly_chart(predicted_vs_measured(result), key="live-verify-figure")


st.sidebar.title("kvplan")
page = st.sidebar.radio("Page", PAGES)
deployment = deployment_inputs() if page != "Verify" else None
try:
    if page == "Verify":
        show_verify()
    elif deployment is not None:
        {"Plan": show_plan, "Compare": show_compare, "Simulate": show_simulate, "Search": show_search}[page](
            deployment)
except PlannerError as error:
    st.error(str(error))
