"""A random model's GGUF (scripts/make_random_model.py) read as the rows of benchmarks/filled_context.py read it: its
byte vocabulary becomes a tokenizer that encodes text to its UTF-8 bytes, and its Llama 3 rope scaling (the
rope_freqs tensor transformers' GGUF reader drops) reaches the fp32 reference.

References: Python's own str.encode (the bytes); transformers' LlamaForCausalLM from the HF folder the GGUF was
written from, whose llama3 rope comes from config.json (ROPE_INIT_FUNCTIONS["llama3"]). Seconds."""
from pathlib import Path

import numpy as np
import pytest

from conftest import load_benchmark, random_llama

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

TEXT = "Hello  wörld, 123\n\n\ttabs  €"


def _vocab_gguf(path: Path, merges: list[str], extra: list[str]) -> None:
    """A GGUF holding only a gpt2-style vocabulary: the 256 ByteLevel byte symbols, then `extra` tokens."""
    from edgekv.export.tokenizer import byte_symbols

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = byte_symbols() + extra
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_byte_vocabulary_gguf_encodes_text_to_its_bytes(tmp_path):
    """The merge an earlier make_random_model wrote ("Ġ Ġ", whose result is no token) made transformers' converter
    refuse the file; the vocabulary is bytes, so the tokenizer is the byte tokenizer, with the file's bos id."""
    from tokenizers import Tokenizer

    from edgekv.export.tokenizer import write_tokenizer

    _vocab_gguf(tmp_path / "m.gguf", ["Ġ Ġ"], ["<unused_256>", "<unused_257>"])
    entry = write_tokenizer(tmp_path / "m.gguf", tmp_path)
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(TEXT).ids == list(TEXT.encode())
    assert entry["bos_token_id"] == 257 and entry["add_bos_token"] is False


def test_a_vocabulary_with_a_byte_merge_is_not_taken_for_bytes(tmp_path):
    """Where a merge of two byte symbols gives a token ("ĠĠ"), text does not encode to bytes: the GPT-2 converter
    runs, and two trailing spaces (one piece for GPT-2's pre-tokenizer) are one token."""
    from tokenizers import Tokenizer

    from edgekv.export.tokenizer import write_tokenizer

    _vocab_gguf(tmp_path / "m.gguf", ["Ġ Ġ"], ["ĠĠ"])
    write_tokenizer(tmp_path / "m.gguf", tmp_path)
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("a  ").ids == [ord("a"), 256]


def test_the_reference_from_a_gguf_applies_llama3_rope_freqs(tmp_path):
    """child_reference over the GGUF of a Llama 3 random model gives the logits of transformers over the HF folder it
    was written from (llama3 rope from config.json), to the GGUF's f16 rounding. The rope is chosen so that its
    scaling matters at these 40 positions: theta 100 and an original context of 16 put 5 of 8 frequencies past the
    low-frequency wavelength, each divided by 32."""
    from transformers import AutoModelForCausalLM

    made = random_llama(tmp_path, gguf=True, std=0.3, head_dim=16, hidden_size=64, intermediate_size=160,
                        num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, rope_theta=100.0,
                        vocab_size=384, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0,
                                                      "low_freq_factor": 1.0, "original_max_position_embeddings": 16,
                                                      "rope_type": "llama3"})
    fc = load_benchmark("filled_context")
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    n_prompt, new = fc.prompt_len(40, 8), 8
    out = tmp_path / "ref.npy"
    before = torch.get_num_threads()
    try:
        fc.child_reference({"model_path": made["gguf"], "ids": ids, "n_prompt": n_prompt, "new_tokens": new,
                            "threads": 1, "chunk": 16, "logits_out": str(out)})
    finally:
        torch.set_num_threads(before)
    model = AutoModelForCausalLM.from_pretrained(made["folder"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids[:n_prompt + new - 1]])).logits[0, n_prompt - 1:].numpy()
    got = np.load(out)
    scale = np.abs(want).max()
    assert scale > 1 and np.abs(got - want).max() <= 2e-3 * scale
