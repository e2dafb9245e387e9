"""scripts/make_random_model.py: random weights at a catalog config's shapes, as an HF folder and a GGUF f16.

References: hand arithmetic of the parameter count from the config; transformers' own loaders (from_pretrained of
the folder, and of the GGUF through its GGUF reader, which undoes llama.cpp's q/k permutation on its own); transformers'
Llama 3 rope (ROPE_INIT_FUNCTIONS["llama3"]) for the rope_freqs tensor. Tiny configs shaped like the catalog's
(GQA, tied and untied heads), seconds each."""
import importlib.util
import json

import pytest

from conftest import ROOT, run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

spec = importlib.util.spec_from_file_location("make_random_model", ROOT / "scripts" / "make_random_model.py")
mrm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mrm)

H, L, HEADS, KV, D, FF, V = 64, 2, 4, 2, 16, 160, 384
LLAMA = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": D, "hidden_act": "silu",
         "hidden_size": H, "intermediate_size": FF, "max_position_embeddings": 4096, "mlp_bias": False,
         "model_type": "llama", "num_attention_heads": HEADS, "num_hidden_layers": L, "num_key_value_heads": KV,
         "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "vocab_size": V, "bos_token_id": 1, "eos_token_id": 2}
# by hand: embedding V x H, per layer q H x HEADS*D, k and v H x KV*D, o HEADS*D x H, gate/up/down 3 x H x FF, two
# norms of H; the final norm H; an untied head V x H
PER_LAYER = H * HEADS * D + 2 * H * KV * D + HEADS * D * H + 3 * H * FF + 2 * H
PARAMS_TIED = V * H + L * PER_LAYER + H


def _make(tmp_path, name, **over):
    entry = tmp_path / f"{name}.json"
    entry.write_text(json.dumps({"name": name, "config": {**LLAMA, **over}}))
    return mrm.make(str(entry), tmp_path / name, echo=lambda s: None)


# catalog-like configs of the other GGUF architectures the script writes: Qwen2 (q/k/v biases, tied head, fp16) and
# Gemma 3 (norms stored as 1 + w, qk-norm, sliding layers; head_dim 256 as the 1B's, the query scale that a GGUF does
# not carry and both llama.cpp and transformers' GGUF reader take as 1/sqrt(256))
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": H, "intermediate_size": FF,
         "max_position_embeddings": 4096, "model_type": "qwen2", "num_attention_heads": HEADS, "num_hidden_layers": L,
         "num_key_value_heads": KV, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
         "torch_dtype": "float16", "vocab_size": V, "bos_token_id": 1, "eos_token_id": 2}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
          "hidden_size": H, "intermediate_size": FF, "max_position_embeddings": 4096, "model_type": "gemma3_text",
          "num_attention_heads": 2, "num_hidden_layers": 6, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
          "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_theta": 1000000, "sliding_window": 8,
          "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": V, "bos_token_id": 2,
          "eos_token_id": [1, 106], "pad_token_id": 0}


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("rand"), "tiny-llama")


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def made(request, tmp_path_factory, untied):
    if request.param == "llama":
        return untied
    entry = tmp_path_factory.mktemp("rand") / f"tiny-{request.param}.json"
    entry.write_text(json.dumps({"name": f"tiny-{request.param}",
                                 "config": {"qwen2": QWEN2, "gemma3": GEMMA3}[request.param]}))
    return mrm.make(str(entry), entry.parent / request.param, echo=lambda s: None)


def test_folder_loads_in_transformers_at_the_hand_counted_shapes(untied):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(untied["folder"])
    assert type(m).__name__ == "LlamaForCausalLM" and m.dtype == torch.bfloat16
    assert sum(p.numel() for p in m.parameters()) == PARAMS_TIED + V * H == untied["params"]
    sd = m.state_dict()
    assert sd["model.layers.1.self_attn.k_proj.weight"].shape == (KV * D, H)
    assert sd["lm_head.weight"].shape == (V, H)
    q = sd["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - 0.02) < 0.002 and torch.all(sd["model.norm.weight"] == 1)
    assert not torch.equal(q, sd["model.layers.1.self_attn.q_proj.weight"].float())  # seeded per tensor
    logits = m.float()(torch.arange(16)[None]).logits
    assert torch.isfinite(logits).all()


def test_tied_head_is_stored_once(tmp_path):
    made = _make(tmp_path, "tied", tie_word_embeddings=True)
    from safetensors import safe_open
    with safe_open(made["folder"] + "/model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    from transformers import AutoModelForCausalLM
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(made["folder"]).parameters()) == PARAMS_TIED


def test_gguf_is_the_same_model_for_transformers_and_for_the_plan(made):
    """transformers' GGUF reader (its own name map, q/k un-permutation and Gemma norm offset) gives the folder's
    logits, to f16 rounding; `edgekv plan` reads the folder and the GGUF to the same weight and state bytes at fp16."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    folder, gguf_file = made["folder"], Path(made["gguf"])
    a = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file.name, dtype=torch.float32)
    ids = (torch.arange(24)[None] * 37) % V
    la, lb = a(ids).logits, b(ids).logits
    assert (la - lb).abs().max() < 2e-3 * la.abs().max()
    rows = []
    for m in (folder, gguf_file):
        p = run_cli("plan", "-m", m, "--device", "pixel8", "--ctx", "2k", "--weights", "fp16", "--json", check=True)
        rows.append(json.loads(p.stdout)["options"][0]["bytes"])
    assert rows[0]["weights"] == rows[1]["weights"] and rows[0]["state"] == rows[1]["state"]


def test_llama3_rope_scaling_is_written_as_llama_cpp_rope_freqs(tmp_path):
    """Llama 3's rope scaling in the GGUF is the rope_freqs tensor: base frequencies / transformers' llama3 ones."""
    scaling = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 512,
               "rope_type": "llama3"}
    made = _make(tmp_path, "llama3", rope_scaling=scaling)
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from edgekv.models.weights import load_gguf
    cfg = AutoConfig.from_pretrained(made["folder"])
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    _, _, factors, types = load_gguf(made["gguf"])
    assert factors is not None and types == ["F16", "F32"]
    assert torch.allclose(torch.tensor(factors), base / scaled, rtol=1e-4)
    # the table is not a parameter: the plan reads the GGUF to the folder's hand-counted parameters
    from edgekv.arch import load_arch
    assert load_arch(made["gguf"]).n_params == load_arch(made["folder"]).n_params == PARAMS_TIED + V * H


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.2-3b", "qwen2.5-1.5b", "gemma-3-1b", "lfm2-350m",
                                  "smollm2-135m"])
def test_catalog_shapes_give_the_published_parameter_count(name):
    """The tensors the script writes for a catalog model (transformers' class on the meta device, a tied head once)
    add up to the parameter count the model's publisher gives (the catalog's params.published, precision exact)."""
    import math

    entry = mrm.read_entry(name)
    assert entry["params"]["precision"] == "exact"
    specs = mrm.tensor_specs(mrm.hf_config(entry))
    assert sum(math.prod(shape) for _, shape in specs) == entry["params"]["published"]


def test_gguf_vocabulary_encodes_text_as_the_folder_tokenizer(untied, tmp_path):
    """The GGUF's byte vocabulary, through transformers' GGUF tokenizer converter (what `edgekv export` of a GGUF
    uses), encodes text to the same ids as the folder's byte-level tokenizer.json: its UTF-8 bytes."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from edgekv.export.tokenizer import write_tokenizer
    write_tokenizer(Path(untied["gguf"]), tmp_path)
    text = "Hello  wörld, 123\n\n\ttabs  €"
    ids = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids
    assert ids == Tokenizer.from_file(untied["folder"] + "/tokenizer.json").encode(text).ids == list(text.encode())
