"""benchmarks/et_llama.py: the HF -> Meta checkpoint conversion that feeds ExecuTorch's own Llama export, checked by
running the converted weights in ExecuTorch's eager Llama (examples/models/llama, the model export_llama traces)
against transformers' LlamaForCausalLM on a tiny random Llama. No export here."""
from pathlib import Path

import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
et = load_benchmark("et_llama")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("executorch.examples.models.llama.llama_transformer")


def tiny(tied: bool):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500.0,
                                   max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a swapped norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return cfg, model


@pytest.mark.parametrize("tied", [True, False])
def test_converted_checkpoint_gives_transformers_logits_in_executorch_llama(tied):
    cfg, model = tiny(tied)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    c = cfg.to_dict()
    ids = torch.tensor([[3, 17, 42, 5, 88, 1, 60, 23, 9, 71]])
    eager = et.eager(et.meta_params(c), et.hf_to_meta(sd, c), max_len=16)
    with torch.no_grad():
        got = eager(ids)[0]
        want = model(ids).logits[0]
    assert got.shape == want.shape
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err


def test_rotary_permutation_is_the_inverse_of_transformers_permute():
    # transformers' convert_llama_weights_to_hf: Meta -> HF is view(h, d/2, 2, in).transpose(1, 2)
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4 * 8, 3)
    hf = w.view(4, 4, 2, 3).transpose(1, 2).reshape(32, 3)
    assert torch.equal(et.to_interleaved(hf, 4), w)


def test_an_unknown_weight_is_refused_not_dropped():
    cfg, model = tiny(True)
    sd = dict(model.state_dict(), **{"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(ValueError, match="q_norm"):
        et.hf_to_meta(sd, cfg.to_dict())


def test_the_export_is_handed_absolute_paths_from_a_relative_work_folder(tmp_path, monkeypatch):
    """build() runs export_llama in the .pte's own folder, so a checkpoint, params or output path relative to the
    caller's folder (filled_context.py --work out/fc) named a file that is not there (FileNotFoundError on
    checkpoint.pth): every path it hands over is absolute."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(et, "write_checkpoint", lambda model, folder: (folder / "checkpoint.pth",
                                                                       folder / "params.json"))
    seen = {}

    def run(cmd, **kw):
        seen["cmd"], seen["cwd"] = cmd, kw["cwd"]
        (Path(kw["cwd"]) / "model.tmp.pte").write_bytes(b"pte")
        return type("P", (), {"returncode": 0})()

    monkeypatch.setattr(et.subprocess, "run", run)
    pte = et.build(Path("out/fc"), Path("m.gguf"), 256, next(iter(et.VARIANTS)), log=lambda s: None)
    cmd = seen["cmd"]
    for flag in ("-c", "-p", "-o"):
        assert Path(cmd[cmd.index(flag) + 1]).is_absolute(), (flag, cmd)
    assert Path(cmd[cmd.index("-c") + 1]).parent.parent == tmp_path / "out" / "fc" / "et_llama"
    assert pte.is_absolute() and pte.read_bytes() == b"pte"
