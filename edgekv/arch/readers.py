"""READERS: the reader per model_type, and arch_from_config / read_config_json, which pick one and build the Arch."""
from __future__ import annotations

from pathlib import Path

from ..errors import EdgekvError
from .config import Cfg, trained_ctx_of
from .deepseek import _deepseek
from .granite import _granite_hybrid
from .hybrid import _falcon_h1, _jamba, _zamba2, from_zamba2_fork, is_zamba2_fork
from .lfm2 import _lfm2
from .mamba import _from_mamba_ssm, _mamba
from .model_types import MODEL_TYPES, model_type
from .qwen3_5 import _qwen3_5
from .rwkv import _rwkv
from .transformer import _decoder
from .types import Arch, Block
from .variants import EXPORTED, VARIANTS, variant


_READER_FUNCTIONS = {f.__name__: f for f in (_deepseek, _mamba, _jamba, _falcon_h1, _zamba2, _rwkv, _lfm2,
                                              _granite_hybrid, _qwen3_5)}
READERS = {
    **{mt: _decoder for mt in VARIANTS},  # the Llama-family variants, declared in edgekv.arch.variants
    **{mt: _READER_FUNCTIONS[t.reader] for mt, t in MODEL_TYPES.items()},  # the others, edgekv.arch.model_types
}
SUPPORTED = sorted(READERS)


def _family(blocks: list[Block]) -> str:
    kinds = {m.kind for b in blocks for m in b.mixers}
    if len(kinds) > 1 or kinds == {"conv"}:  # a conv-only LFM2 config: plain recurrent layers, planned as a hybrid
        return "hybrid"
    return {"attention": "transformer", "mla": "mla", "ssm": "ssm", "linear": "linear"}[kinds.pop()]


def arch_from_config(config: dict, name: str, source: str) -> Arch:
    if not isinstance(config, dict):
        raise EdgekvError(f"{source}: config must be a JSON object")
    if "model_type" not in config and isinstance(config.get("ssm_cfg"), dict) and "d_model" in config:
        config = _from_mamba_ssm(config, source)
    mt = config.get("model_type")
    wrapper = variant(mt) or model_type(mt)
    if wrapper and wrapper.text_model and isinstance(config.get("text_config"), dict):  # a multimodal wrapper (Gemma
        # 3, Qwen3.5): plan the text model, with the wrapper's fields it falls back to
        mt = wrapper.text_model
        config = {**{f: config.get(f) for f in wrapper.wrapper_fields}, **config["text_config"], "model_type": mt}
    # Zyphra's fork's names (Zamba2-1.2B before transformers 4.48)
    if getattr(model_type(mt), "fork_names", False) and is_zamba2_fork(config):
        config = from_zamba2_fork(config, source)
    if not isinstance(mt, str) or mt not in READERS:
        raise EdgekvError(f"{source}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED)}")
    c = Cfg(config, source)
    try:
        hidden, vocab, blocks, ws = READERS[mt](c, mt)
    except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, AttributeError) as e:
        raise EdgekvError(f"{source}: malformed {mt} config ({type(e).__name__}: {e})") from None
    if not blocks:
        raise EdgekvError(f"{source}: config has no layers")
    max_pos = c.int("max_position_embeddings", "n_positions", "context_length", default=None)
    return Arch(name=name, model_type=mt, family=_family(blocks), hidden=hidden, vocab=vocab, blocks=tuple(blocks),
                weights=tuple(ws), max_position=int(max_pos) if max_pos else None, source=source,
                trained_ctx=trained_ctx_of(c))


def read_config_json(path: str | Path) -> Arch:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise EdgekvError(f"{path}: no config.json there")
    from ..jsonfile import read_config
    config = read_config(p)
    name = p.parent.name if p.name == "config.json" else p.stem
    return arch_from_config(config, name or "model", str(p))


# the model types edgekv.models.llama exports (the variants declared exported), here so that torch-free code (the
# planner's memory model) and the export module read the same list
LLAMA_EXPORT_TYPES = EXPORTED
