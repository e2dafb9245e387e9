"""Which runtime LLM APIs load an export: edgekv's own stepper, ONNX Runtime GenAI, ExecuTorch's LLM runner.

Pure Python, no torch: the rules read the StateLayout only, so `edgekv export --runner` refuses a strategy in one line
before any stage runs, and the manifest records the same answers (artifacts[].runners; runners_unsupported).

    edgekv                 the artifact's explicit-state entry points (tokens, pos, state, rows): `edgekv run
                           --runtime ort|executorch`, `edgekv profile`, the Android demo's explicit-state backends
    onnxruntime-genai      ONNX Runtime GenAI (og.Model / og.Generator; its Java, C#, Objective-C APIs): a folder with
                           genai_config.json, tokenizer.json + tokenizer_config.json and a graph fed input_ids,
                           attention_mask and past_key_values.%d.key/value (`--runner genai`, edgekv.export.genai)
    executorch-llm-runner  ExecuTorch's LLM runner (TextLLMRunner in C++ and Python, LlmModule on Android, the iOS
                           runner): a .pte whose `forward(tokens, input_pos)` keeps the cache in the program's mutable
                           buffers, with the metadata methods the runner reads (`--runner executorch`,
                           edgekv.export.et_runner)
"""
from __future__ import annotations

from ..errors import EdgekvError

EDGEKV = "edgekv"
GENAI = "onnxruntime-genai"
ET_RUNNER = "executorch-llm-runner"
# --runner NAME -> (runner, the format it needs)
OPTIONS = {"genai": (GENAI, "onnx"), "executorch": (ET_RUNNER, "pte")}
# `edgekv run --runtime NAME` for a runner -> the runner it drives
RUNTIMES = {"genai": GENAI, "executorch-runner": ET_RUNNER}


def parse_runners(text: str | None, formats) -> tuple[str, ...]:
    """--runner genai[,executorch] -> ("genai", ...); each needs its format among --format."""
    if not text:
        return ()
    names = tuple(dict.fromkeys(r.strip().lower() for r in text.split(",") if r.strip()))
    bad = [r for r in names if r not in OPTIONS]
    if bad or not names:
        raise EdgekvError(f"--runner {text!r}: choose from {', '.join(OPTIONS)} (comma-separated)")
    for r in names:
        fmt = OPTIONS[r][1]
        if fmt not in formats:
            raise EdgekvError(f"--runner {r} writes {'an' if fmt[0] in 'aeiou' else 'a'} {fmt} artifact: add {fmt} "
                              f"to --format (got {','.join(formats)})")
    return names


def _describe(layout) -> str:
    roles = sorted({t.role.split(".")[0] for t in layout.tensors})
    return f"{layout.strategy}: {'/'.join(roles)} state"


def why_not(runner: str, layout) -> str | None:
    """None when `runner` can carry this StateLayout; else one line saying why not.

    GenAI: its decoder feeds past_key_values.%d.key / .value of one slot per position ([1, Hkv, context_length, D],
    past_present_share_buffer) in a float dtype, read by GroupQueryAttention (the op its own builder emits, and the
    one edgekv's fused float-cache graph already uses). A model's own sliding-window layers (Gemma 3) are what its
    builder emits too: GroupQueryAttention's window-sized cache (sliding_window_cache 1), whose rows GenAI sizes
    from genai_config.json's sliding_window (edgekv.export.genai.sliding_window). Its quantized caches are
    PagedAttention's with static per-channel scales (onnxruntime_genai/models/kv_cache_variant.py), not per-token
    group codes; the `window` strategy's ring of W + S slots (sinks) is not a cache it sizes; a latent or a recurrent
    state is not a key/value cache.
    ExecuTorch's runner: it calls forward(tokens, input_pos) and keeps nothing itself, so any state the program writes
    in place works (its own Llama export gives Gemma 3's local layers a ring, CustomRingKVCache); edgekv writes plain
    and quantized caches with one slot per position in place (edgekv.models.swaps: custom_sdpa in every layer). A
    rolling window (the strategy's or a model's own sliding layers), a latent or a recurrent state is not exported as
    runner variant."""
    roles = {t.role for t in layout.tensors}
    rolling = any(t.role in ("key", "value") and t.shape[2] != layout.ctx for t in layout.tensors)
    kv_only = roles <= {"key", "value", "key.scale", "value.scale", "key.zero", "value.zero"}
    if runner == GENAI:
        if not kv_only:
            return (f"GenAI's decoder feeds past key/value caches only; {_describe(layout)} is not one it can carry "
                    "(use edgekv's stepper: edgekv run --runtime ort)")
        if roles != {"key", "value"} or {t.dtype for t in layout.tensors} - {"float32", "float16"}:
            return (f"GenAI's CPU cache holds float keys and values; {layout.strategy} stores quantized codes "
                    "(use kv or kv:dtype=fp16, or edgekv's stepper / the ExecuTorch runner for a quantized cache)")
        if rolling and _strategy_ring(layout):
            return (f"GenAI keeps one cache slot per position, or a model's own sliding window; {layout.strategy} "
                    "keeps a ring of window + sink slots (use edgekv's stepper: edgekv run --runtime ort)")
        return None
    if runner == ET_RUNNER:
        if not kv_only:
            return (f"the runner variant keeps a key/value cache in the program's buffers; {_describe(layout)} is not "
                    "exported that way yet (use edgekv's stepper: edgekv run --runtime executorch)")
        if rolling and _strategy_ring(layout):
            return (f"the runner variant writes one cache slot per position in place; {layout.strategy} keeps a ring "
                    "buffer, not exported that way yet (use edgekv run --runtime executorch)")
        if rolling:  # ExecuTorch's runner only calls forward: its own Llama export keeps such layers in a ring
            return ("edgekv's runner .pte writes one cache slot per position in place, and this model's sliding-"
                    "window layers keep a ring that edgekv does not write in place yet (an edgekv limit: ExecuTorch's "
                    "runner runs a ring, as export_llama --local_global_attention builds it); use --runner genai, or "
                    "edgekv run --runtime executorch")
        return None
    raise ValueError(runner)


def _strategy_ring(layout) -> bool:
    """Whether the layout's fewer-than-ctx slots are the strategy's own ring (its window_tokens trait), not the
    model's native sliding-window layers."""
    from ..strategies import parse_strategy
    return bool(parse_strategy(layout.strategy).window_tokens)


def check_runners(runners, layout) -> None:
    """One line for the first requested runner that cannot carry the layout."""
    for r in runners:
        name = OPTIONS[r][0]
        reason = why_not(name, layout)
        if reason:
            raise EdgekvError(f"--runner {r}: {reason}")


def unsupported(layout, artifacts: list[dict]) -> dict:
    """The manifest's runners_unsupported: {runner: one line} for every runner no artifact of this export serves."""
    served = {r for a in artifacts for r in a.get("runners", [])}
    out = {}
    for r, (name, fmt) in OPTIONS.items():
        if name in served:
            continue
        out[name] = why_not(name, layout) or f"this export has no {name} artifact: export with --runner {r} " \
                                                 f"(--format {fmt})"
    return out


def require(manifest: dict, folder, runner: str) -> dict:
    """The artifact entry that `runner` loads, or one line naming what is missing: the variant, or a file."""
    from pathlib import Path
    fmt = {GENAI: "onnx", ET_RUNNER: "pte"}[runner]
    arts = [a for a in manifest["artifacts"] if a["format"] == fmt]
    a = next((a for a in arts if runner in a.get("runners", [])), None)
    if a is None:
        reason = (manifest.get("runners_unsupported") or {}).get(runner) or why_not(runner, _layout_view(manifest))
        flag = next(k for k, v in OPTIONS.items() if v[0] == runner)
        what = f"its {arts[0]['file']} is edgekv's explicit-state variant" if arts else f"it has no {fmt} artifact"
        raise EdgekvError(f"{folder}: {runner} cannot load this export: {what}; "
                          + (reason if reason else f"export it with --runner {flag}"))
    # what the runner opens whatever the manifest lists: GenAI its config and tokenizer files, the runner tokenizer.json
    must = ["genai_config.json", "tokenizer.json", "tokenizer_config.json"] if runner == GENAI else ["tokenizer.json"]
    need = list(dict.fromkeys([a["file"], *a.get("runner_files", []), *must]))
    for name in need:
        if not (Path(folder) / name).is_file():
            raise EdgekvError(f"{folder}: {runner} needs {name}, which is missing")
    return a


class _layout_view:
    """The few StateLayout fields why_not reads, from a manifest's state entry."""

    def __init__(self, manifest: dict):
        from types import SimpleNamespace
        st = manifest["state"]
        self.strategy, self.ctx = st["strategy"], int(st["ctx"])
        self.tensors = [SimpleNamespace(role=t["role"], dtype=t["dtype"], shape=t["shape"]) for t in st["tensors"]]
