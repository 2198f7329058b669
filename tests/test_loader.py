"""Loading: the bundled GGUF, a Hugging Face folder, random weights from a config, and damaged input."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from engine.core.config import EngineConfig
from engine.core.errors import ConfigError, LoaderError, RequestError
from engine.core.sequence import SamplingParams
from engine.core.spec import spec_from_config
from engine.llm import LLM
from engine.model.loader import load_model, resolve

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 128},
        "tie_word_embeddings": False, "eos_token_id": [1, 2]}


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The engine's fused weights split back into Hugging Face names."""
    attention = model.config.attention
    q, kv = attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim
    state = {}
    for name, tensor in model.state_dict().items():
        if "qkv_proj" in name:
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                state["model." + name.replace("qkv_proj", part)] = rows.clone()
        elif "gate_up_proj" in name:
            for part, rows in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                state["model." + name.replace("gate_up_proj", part)] = rows.clone()
        else:
            state[name if name.startswith("lm_head") else "model." + name] = tensor.clone()
    return state


def test_hf_folder_round_trip(tmp_path, engine):
    ids = engine.tokenizer.encode("A folder of safetensors holds the same model")
    save_file(hf_state_dict(engine.core.model), str(tmp_path / "model.safetensors"))
    config = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
              "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
              "tie_word_embeddings": True, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve(str(tmp_path)).kind == "hf"
    folder_engine = LLM(model=str(tmp_path), num_pages=64)
    assert torch.equal(folder_engine.score(ids), engine.score(ids))


def test_random_weights_from_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    loaded = load_model(str(path), "fp32", "cpu", seed=3)
    assert loaded.source.kind == "random" and loaded.tokenizer is None
    assert loaded.config.rope.rope_type == "llama3" and loaded.config.eos_token_ids == (1, 2)
    assert sum(p.numel() for p in loaded.model.parameters()) == loaded.config.total_parameters
    again = load_model(str(path), "fp32", "cpu", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.parameters(), again.model.parameters()))
    llm = LLM(model=str(path), num_pages=32, seed=3)
    result = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(result.token_ids) == 6 and all(0 <= t < 256 for t in result.token_ids)
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.add_request("text needs a tokenizer")


def test_llama3_rope_scaling_matches_transformers():
    import transformers

    from engine.model.layers.rotary import rope_inverse_frequencies

    hf_config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    expected, _ = init(hf_config, "cpu")
    ours = rope_inverse_frequencies(16, spec_from_config(TINY, "tiny").rope)
    torch.testing.assert_close(ours, expected.float())


def test_damaged_and_unknown_models(tmp_path, smollm_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm_path.read_bytes()[:5_000_000])
    with pytest.raises(LoaderError, match="truncated or corrupt"):
        load_model(str(truncated))
    with pytest.raises(LoaderError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps({k: v for k, v in TINY.items() if k != "hidden_size"}))
    with pytest.raises(ConfigError, match="hidden_size"):
        load_model(str(broken))
    bad_rope = tmp_path / "rope.json"
    bad_rope.write_text(json.dumps({**TINY, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}))
    with pytest.raises(ConfigError, match="longrope"):
        load_model(str(bad_rope))


@pytest.mark.parametrize("weights", ["fp32", "native"])
def test_a_gguf_cut_to_two_layers_holds_the_full_models_first_two(weights):
    """`--num-layers 2` reads only the first two blocks of the GGUF (INT4 as shipped, or dequantized): every tensor
    it holds is the full model's, to the bit."""
    engine = EngineConfig(model="smollm2-135m", weights=weights)
    full = load_model("smollm2-135m", "fp32", "cpu", engine=engine).model.state_dict()
    cut = load_model("smollm2-135m", "fp32", "cpu", engine=replace(engine, num_layers=2)).model.state_dict()
    assert any(name.startswith("layers.1.") for name in cut) and not any(name.startswith("layers.2.") for name in cut)
    assert all(torch.equal(tensor, full[name]) for name, tensor in cut.items())


def _resident_kib_of_mapping(path) -> int:
    """This process's resident KiB of the mappings of `path` (Linux /proc/self/smaps)."""
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:      # a mapping's first line: range perms offset dev inode
                inside = line.rstrip().endswith(str(path))
            elif inside and head[0] == "Rss:":
                resident += int(head[1])
    return resident


@pytest.mark.parametrize("weights", ["fp32", "native"])
def test_a_loaded_gguf_leaves_neither_its_pages_nor_its_parsed_vocabulary_behind(smollm_path, weights):
    """The model holds its own copy of every weight: the file's pages that reading it touched go back to the page
    cache (SmolLM2's 94 MB stayed resident in every process that loaded it), and of the parsed metadata only the
    values stay (the reader's per-token arrays were 95 MB)."""
    from engine.model.loader import _read_gguf

    model = load_model("smollm2-135m", "fp32", "cpu", engine=EngineConfig(model="smollm2-135m", weights=weights)).model
    reader, fields = _read_gguf(smollm_path)
    assert _resident_kib_of_mapping(smollm_path.resolve()) < 1024
    assert not reader.fields and len(fields["tokenizer.ggml.tokens"]) == 49152
    assert reader.tensors[0].data.reshape(-1)[:4096].any()          # still readable: pages fault back in from the cache
    assert 0 < _resident_kib_of_mapping(smollm_path.resolve()) < 1024 + 4 * 1024
    assert sum(p.numel() for p in model.parameters()) > 0


def test_engines_of_one_gguf_share_its_weights_until_the_last_closes():
    """Two engines of the same file and weights hold one copy of them (a verification runs a served and a probe
    engine: each held 540 MB of SmolLM2), each with its own KV pool, and decode alike interleaved; other weights
    are another copy; the copy goes with the last engine that uses it."""
    import gc
    import weakref

    settings = dict(model="smollm2-135m", num_layers=2, kv_cache_gib=0.02)
    prompt, greedy = [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(weights="fp32", **settings) as first, LLM(weights="fp32", **settings) as second, \
            LLM(weights="native", **settings) as native:
        assert first.core.model is second.core.model and first.core.kv_cache is not second.core.kv_cache
        assert native.core.model is not first.core.model
        assert first.generate([prompt], greedy)[0].token_ids == second.generate([prompt], greedy)[0].token_ids
        weights = weakref.ref(first.core.model)
        first.close()
        assert weights() is second.core.model
    gc.collect()
    assert weights() is None
