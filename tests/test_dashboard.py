"""The Streamlit dashboard through streamlit.testing: every page renders, inputs change the numbers, bad
uploads give an error message rather than a traceback."""
from __future__ import annotations

import json

import pytest
from conftest import REPO
from streamlit.testing.v1 import AppTest

APP = str(REPO / "app.py")


def fresh() -> AppTest:
    return AppTest.from_file(APP, default_timeout=180).run()


def metrics(app: AppTest) -> dict[str, str]:
    return {metric.label: metric.value for metric in app.metric}


def test_plan_page_renders_the_default_deployment():
    app = fresh()
    assert not app.exception and not app.error
    shown = metrics(app)
    assert shown["Max context (tokens)"] == "262,144"            # Kimi K2.6's limit: FP8 KV on 8 H200 holds more
    assert int(shown["Max concurrency"].replace(",", "")) > 0
    assert len(app.get("plotly_chart")) == 2                     # memory, and concurrency against context


def test_plan_tiles_keep_each_figure_whole_with_its_error_bar_and_say_where_it_came_from():
    """A 1400-pixel window cut "30,483 tok/s ±217.8%" to "30,483 tok/s…": the unit goes to the label and the error
    bar beneath the value; the layout and the calibration (engine, points) are named."""
    app = fresh()
    tiles = {metric.label: metric for metric in app.metric}
    for label in ("Decode (tok/s)", "Prefill (tok/s)"):
        value = tiles[label].value
        assert value.replace(",", "").isdigit() and len(value) <= 9, value
        assert tiles[label].delta.startswith("±") and tiles[label].delta.endswith("%")
    captions = " ".join(caption.value for caption in app.caption)
    assert "Layout: 1 x TP 8" in captions and "public measurements" in captions
    app.sidebar.selectbox[4].set_value("sglang").run()            # the serving engine
    captions = " ".join(caption.value for caption in app.caption)
    assert not app.exception and ("SGLang" in captions or "sglang" in captions)
    app.sidebar.number_input[0].set_value(32).run()               # four nodes: Kimi K2.6 spreads wide
    assert "wide expert parallelism over 32 GPUs, 4 nodes of 8" in " ".join(c.value for c in app.caption)


def test_a_changed_input_changes_the_numbers():
    app = fresh()
    before = metrics(app)
    app.sidebar.selectbox[3].set_value("bf16").run()              # the KV cache dtype
    after = metrics(app)
    assert not app.exception
    assert int(after["Max concurrency"].replace(",", "")) < int(before["Max concurrency"].replace(",", ""))
    app.sidebar.number_input[0].set_value(16).run()               # GPUs
    assert metrics(app)["KV capacity (tokens)"] != after["KV capacity (tokens)"]


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not JSON"),
    (json.dumps({"model_type": "gpt2", "n_layer": 12}).encode(), "unsupported architecture 'gpt2'"),
    (json.dumps({"model_type": "llama"}).encode(), "lacks the key"),
])
def test_a_bad_upload_shows_an_error_not_a_traceback(content, message):
    app = fresh()
    app.sidebar.file_uploader[0].upload("config.json", content, "application/json").run()
    assert not app.exception
    assert any(message in error.value for error in app.error)


def test_a_good_upload_is_planned():
    app = fresh()
    config = (REPO / "planner" / "data" / "model-configs" / "qwen3-8b.json").read_bytes()
    app.sidebar.file_uploader[0].upload("config.json", config, "application/json").run()
    assert not app.exception and not app.error
    assert "uploaded" in app.subheader[0].value


@pytest.mark.parametrize("page", ["Compare", "Simulate", "Verify"])
def test_every_page_renders(page):
    app = fresh()
    app.sidebar.radio[0].set_value(page).run()
    assert not app.exception and not app.error
    if page == "Compare":
        assert len(app.dataframe) == 2 and "FP8 KV" in app.markdown[0].value
    if page == "Simulate":
        assert {"TTFT p99", "TPOT p99", "Output throughput", "Preemptions", "Prefix-cache hit rate"} <= set(metrics(app))
        assert len(app.get("plotly_chart")) == 4
    if page == "Verify":
        assert app.dataframe or app.info
        if app.dataframe:
            assert list(app.dataframe[0].value["metric"])[0] == "kv_capacity_tokens"


def test_simulate_page_reacts_to_the_load():
    app = fresh()
    app.sidebar.radio[0].set_value("Simulate").run()
    light = metrics(app)["TTFT p99"]
    app.number_input[0].set_value(40.0).run()                      # 20x the arrival rate
    assert not app.exception
    assert float(metrics(app)["TTFT p99"].split()[0]) > float(light.split()[0])


def test_simulate_page_shows_the_prefix_cache():
    """A shared system prompt (before each request's own prompt) raises the hit rate the page shows; the hit rate and
    TTFT against the cached share of the prompt are plotted; with caching off the curve is gone and the rate is 0."""
    app = fresh()
    app.sidebar.radio[0].set_value("Simulate").run()
    assert metrics(app)["Prefix-cache hit rate"] == "0%"
    shared = next(box for box in app.number_input if box.label == "Shared system prompt (tokens)")
    shared.set_value(1536).run()
    assert not app.exception                            # 1536 of the 1536 + 2048 prompt tokens: 43%
    assert 35 <= int(metrics(app)["Prefix-cache hit rate"].rstrip("%")) <= 43
    app.sidebar.checkbox[0].uncheck().run()
    assert metrics(app)["Prefix-cache hit rate"].startswith("0%") and len(app.get("plotly_chart")) == 3


def test_search_page_ranks_configurations_and_gives_deploy_commands():
    """Llama-3.1-8B on up to 2 H100s: the Pareto chart, the ranked table, the commands of the best; a
    tighter TPOT SLO than any configuration meets says so."""
    app = fresh()
    app.sidebar.selectbox[0].set_value("llama-3.1-8b").run()
    app.sidebar.selectbox[1].set_value("h100-sxm").run()
    app.sidebar.number_input[0].set_value(2).run()
    app.sidebar.radio[0].set_value("Search").run()
    assert not app.exception and not app.error
    assert int(metrics(app)["Meet the SLOs"]) > 0 and len(app.get("plotly_chart")) == 1
    assert app.dataframe[0].value["usd_per_million_tokens"].is_monotonic_increasing
    assert any(block.value.startswith("vllm serve meta-llama/Llama-3.1-8B-Instruct") for block in app.code)
    app.number_input[1].set_value(0.001).run()                     # TPOT p99 of 1 ms
    assert not app.exception and any("nothing meets these SLOs" in w.value for w in app.warning)


def test_verify_page_points_at_a_live_endpoint():
    """The endpoint form: a run without a calibration, or with one that does not exist, is refused in one line."""
    app = fresh()
    app.sidebar.radio[0].set_value("Verify").run()
    next(radio for radio in app.radio if radio.label == "Verify").set_value("A live endpoint").run()
    assert not app.exception and len(app.text_input) == 2
    app.button[0].click().run()
    assert app.error and "calibrate --endpoint" in app.error[0].value
    app.text_input[1].set_value("/nonexistent/endpoint.calibration.json").run()
    app.button[0].click().run()
    assert not app.exception and app.error and "/nonexistent/endpoint.calibration.json" in app.error[0].value
