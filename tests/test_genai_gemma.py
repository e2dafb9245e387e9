"""Gemma 3 through ONNX Runtime GenAI (issue 42): GenAI's own builder emits Gemma 3's local layers as
GroupQueryAttention with a window-sized cache, as edgekv's graph has them, and sizes that cache from genai_config.json's
sliding_window (window_size + cache_slack rows; onnxruntime-genai src/models/windowed_kv_cache.cpp). So `export
--runner genai` writes that block and GenAI runs edgekv's Gemma graph. References: Gemma 3 270M's published config
(18 layers, every 6th global, window 512) by hand; transformers' Gemma3ForCausalLM logits on the same weights."""
import json
import sys

import numpy as np
import pytest

from conftest import ROOT

from edgekv.export import genai
from edgekv.export.runners import GENAI, why_not


def layout(model: str, strategy: str, ctx: int):
    from edgekv.arch import load_arch
    from edgekv.models import layout_for
    from edgekv.strategies import parse_strategy
    return layout_for(load_arch(model), parse_strategy(strategy), ctx)


def test_gemma3_sliding_layers_get_a_genai_window_of_exactly_their_rows():
    # gemma-3-270m: layer_types repeat 5 sliding + 1 full over 18 layers (layers 5, 11, 17 are global), W = 512
    lay = layout("gemma-3-270m", "kv", 2048)
    assert why_not(GENAI, lay) is None
    sw = genai.sliding_window(lay)
    assert sw == {"window_size": 511, "cache_slack": 1, "slide_key_value_cache": False, "slide_inputs": False,
                  "layers": [i for i in range(18) if i % 6 != 5]}
    assert sw["window_size"] + sw["cache_slack"] == 512  # GenAI's C = window_size + cache_slack: the graph's rows
    # within the window every layer keeps one slot per position: no sliding block
    assert genai.sliding_window(layout("gemma-3-270m", "kv", 512)) is None
    # a model without sliding layers has none either
    assert genai.sliding_window(layout("smollm2-135m", "kv", 2048)) is None


def test_the_window_strategys_ring_is_still_refused_for_genai():
    reason = why_not(GENAI, layout("smollm2-135m", "window:w=256,sinks=4", 2048))
    assert reason and "ring of window + sink slots" in reason
    reason = why_not(GENAI, layout("gemma-3-270m", "kv-int8", 2048))
    assert reason and "quantized codes" in reason


@pytest.mark.slow
def test_genai_runs_edgekvs_gemma3_graph_as_transformers_computes_it(tmp_path):
    """A random Gemma 3 (window 8, sliding + global layer) exported with --runner genai: GenAI's Generator, fed a
    36-token prompt in one call and then 12 tokens one at a time (positions far past the window), gives the logits
    transformers' Gemma3ForCausalLM gives on the whole sequence. About a minute (the ONNX lowering)."""
    torch = pytest.importorskip("torch")
    og = pytest.importorskip("onnxruntime_genai")
    from transformers import AutoModelForCausalLM

    from conftest import run_cli
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_random_model as mrm

    cfg = {"architectures": ["Gemma3ForCausalLM"], "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh",
           "hidden_size": 64, "intermediate_size": 160, "max_position_embeddings": 4096, "model_type": "gemma3_text",
           "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 1, "query_pre_attn_scalar": 32,
           "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_theta": 1000000, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"], "torch_dtype": "bfloat16", "vocab_size": 384,
           "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}
    (tmp_path / "tiny-gemma3.json").write_text(json.dumps({"name": "tiny-gemma3", "config": cfg}))
    mrm.make(str(tmp_path / "tiny-gemma3.json"), tmp_path / "gemma", std=0.2, gguf_file=False, echo=lambda s: None)
    out = tmp_path / "out"
    p = run_cli("export", "-m", tmp_path / "gemma", "--format", "onnx", "--runner", "genai", "--max-ctx", 64,
                "--threads", 1, "-o", out)
    assert p.returncode == 0, p.stderr
    sw = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]["sliding_window"]
    assert sw["layers"] == [0] and sw["window_size"] + sw["cache_slack"] == 8
    assert "onnxruntime-genai" in json.loads((out / "manifest.json").read_text())["artifacts"][0]["runners"]

    rng = np.random.default_rng(0)
    seq = [2] + rng.integers(3, 256, 47).tolist()
    prompt, rest = seq[:36], seq[36:]
    model = og.Model(str(out))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=64, do_sample=False)
    gen = og.Generator(model, params)
    got = []
    gen.append_tokens(np.asarray(prompt, dtype=np.int32))
    got.append(gen.get_logits()[0, -1])
    for t in rest:
        gen.append_tokens(np.asarray([t], dtype=np.int32))
        got.append(gen.get_logits()[0, -1])
    got = np.stack(got).astype(np.float64)

    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "gemma", dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    with torch.no_grad():
        want = ref_model(torch.tensor([seq])).logits[0, 35:].double().numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.02 * scale, (np.abs(got - want).max(), scale)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    # the window matters at these positions: the same weights attending to everything give other logits
    ref_model.config.sliding_window = 10_000
    for layer in ref_model.model.layers:
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        full = ref_model(torch.tensor([seq])).logits[0, 35:].double().numpy()
    assert np.abs(full - want).max() > 0.1 * scale
    # `edgekv run --runtime genai` (GenAI's Generator and tokenizer, max_length kept at max_ctx) generates what
    # edgekv's own loop generates on the same graph, past the window
    runs = {}
    for rt in ("genai", "ort"):
        p = run_cli("run", out, "--runtime", rt, "-p", "The capital of France is a city", "-n", 12, "--json",
                    "--threads", 1)
        assert p.returncode == 0, p.stderr
        runs[rt] = json.loads(p.stdout)
    assert runs["genai"]["new_tokens"] == 12 and runs["genai"]["prompt_tokens"] > 8
    assert runs["genai"]["tokens"] == runs["ort"]["tokens"]


def test_gemma3_refused_by_the_executorch_runner_says_whose_limit_it_is():
    """ExecuTorch's runner only calls forward(tokens, input_pos); its own Llama export runs Gemma 3's local layers as
    a ring (examples/models/llama/attention.py RingKVCache, export_llama --local_global_attention). The refusal is
    edgekv's, in one line, and names the runner that does run this export."""
    from edgekv.export.runners import ET_RUNNER
    reason = why_not(ET_RUNNER, layout("gemma-3-270m", "kv", 2048))
    assert reason and "\n" not in reason
    assert "an edgekv limit" in reason and "--runner genai" in reason
    # a window strategy's ring keeps its own message
    assert "ring buffer, not exported that way yet" in why_not(ET_RUNNER, layout("smollm2-135m", "window:w=64", 2048))
    # within the window Gemma's cache is one slot per position: the runner variant takes it
    assert why_not(ET_RUNNER, layout("gemma-3-270m", "kv", 512)) is None
