"""What `edgekv plan` reads and says before any arithmetic: published configs read as transformers reads them (bare
Infinity / NaN, Zyphra's own Zamba2 names), one-line did-you-mean answers for a mistyped name, and a demo whose
output is the table, not a list of what does not apply."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgekv.errors import EdgekvError

ROOT = Path(__file__).resolve().parents[1]

# mistralai/Mamba-Codestral-7B-v0.1, config.json as published on the Hub
# (https://huggingface.co/mistralai/Mamba-Codestral-7B-v0.1/blob/main/config.json; transformers' Mamba2Config names,
# written by transformers 4.44, which writes float infinity as the bare token Infinity); the test machine cannot
# download it, so the test checks the shape against the parameter count the Hub lists (7.29B, safetensors)
CODESTRAL_CONFIG = """{
  "_name_or_path": "/raid/pablog/codestral-mamba",
  "architectures": ["Mamba2ForCausalLM"],
  "bos_token_id": 0,
  "chunk_size": 256,
  "conv_kernel": 4,
  "eos_token_id": 0,
  "expand": 2,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.1,
  "layer_norm_epsilon": 1e-05,
  "model_type": "mamba2",
  "n_groups": 8,
  "norm_before_gate": true,
  "num_heads": 128,
  "num_hidden_layers": 64,
  "pad_token_id": 0,
  "rescale_prenorm_residual": false,
  "residual_in_fp32": true,
  "rms_norm": true,
  "state_size": 128,
  "tie_word_embeddings": false,
  "time_step_floor": 0.0001,
  "time_step_init_scheme": "random",
  "time_step_limit": [0.0, Infinity],
  "time_step_max": 0.1,
  "time_step_min": 0.001,
  "time_step_rank": 256,
  "time_step_scale": 1.0,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.44.0.dev0",
  "use_bias": false,
  "use_cache": true,
  "use_conv_bias": true,
  "vocab_size": 32768
}
"""


def cli(*args, env=None):
    """edgekv in a fresh process: (exit code, stdout, stderr)."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    e.pop("COLUMNS", None)
    p = subprocess.run([sys.executable, "-m", "edgekv.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env=e, timeout=300)
    return p.returncode, p.stdout, p.stderr


def invoke(*args):
    """edgekv in this process (click's runner): (exit code, stdout, stderr)."""
    from edgekv.cli import main
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def one_line_exit_2(code, err, needle=""):
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("edgekv: error: "), err
    assert needle in err, err


# ---- configs as transformers reads them ----


def test_mamba_codestral_config_with_a_bare_infinity_plans(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(CODESTRAL_CONFIG)
    # transformers reads it with Python's json module, which takes the bare Infinity
    assert json.loads(CODESTRAL_CONFIG)["time_step_limit"] == [0.0, float("inf")]
    code, out, err = cli("plan", "-d", "pixel8", "-c", "32k", "-m", p, "--strategy", "ssm", "--json")
    assert code in (0, 3), err  # 3: it does not fit a phone's budget; it was planned
    assert "NaN" not in out and "Infinity" not in out
    opt = json.loads(out)["options"][0]
    # by hand: 64 layers x (128 heads x 64 head size x 128 state x 4 B fp32 SSM state
    #                       + conv state over d_inner 8192 + 2 x 8 groups x 128 channels, kernel 4 - 1 columns, fp32)
    assert opt["bytes"]["state"] == 64 * (128 * 64 * 128 * 4 + (8192 + 2 * 8 * 128) * 3 * 4)
    # weights: int4 on a phone, 7.29B parameters (the Hub's count) at ~0.56 B each: 3-5 GB
    assert 3.0e9 < opt["bytes"]["weights"] < 5.0e9
    from edgekv.arch import arch_from_config
    assert abs(arch_from_config(json.loads(CODESTRAL_CONFIG), "c", "config.json").n_params / 7.29e9 - 1) < 0.002
    # a file edgekv writes itself (a profile report, a manifest) stays strict JSON
    from edgekv.jsonfile import read_json
    r = tmp_path / "report.json"
    r.write_text('{"peak": NaN}')
    with pytest.raises(EdgekvError, match="not valid JSON"):
        read_json(r)


@pytest.mark.parametrize("model,field,value", [
    ("deepseek-v3", ("q_lora_rank",), "Infinity"),
    ("deepseek-v3", ("q_lora_rank",), "NaN"),
    ("deepseek-v2-lite", ("rope_scaling", "original_max_position_embeddings"), "Infinity"),
    ("deepseek-v2-lite", ("rope_scaling", "original_max_position_embeddings"), "NaN"),
    ("llama-3.2-1b", ("max_position_embeddings",), "Infinity"),
])
def test_a_non_finite_size_in_a_config_is_one_line(model, field, value, tmp_path):
    """A bare Infinity / NaN is read (as transformers reads it), but one that would reach the arithmetic as a size is
    refused in one line naming the field, not a traceback nor NaN in the plan."""
    from edgekv.arch import catalog_entry
    cfg = catalog_entry(model)["config"]
    d = cfg
    for k in field[:-1]:
        d = d[k]
    d[field[-1]] = "@@"
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg).replace('"@@"', value))
    code, out, err = invoke("plan", "-d", "h100", "-c", "4k", "-m", p, "--json")
    one_line_exit_2(code, err, field[-1])


# ---- Zyphra's own Zamba2 config ----


# Zyphra/Zamba2-1.2B config.json at revision 4f8e85cd31975fe07d8fc3145239d58913192294, written by Zyphra's
# transformers fork before transformers read Zamba2. The fork's own names (transformers' in brackets):
# layers_block_type 'm' / 'g' ('mamba' / 'hybrid'), state_size (mamba_d_state), conv_dimension (mamba_d_conv),
# expansion_factor (mamba_expand), mamba_headdim (transformers derives it from n_mamba_heads), lora_rank
# (adapter_rank), use_shared_attention_lora (use_shared_attention_adapter), ffn_hidden_size (intermediate_size);
# num_mem_blocks is the same name in both. Values as edgekv/catalog/zamba2-1.2b.json's config_notes record them.
ZAMBA2_FORK = {
    "add_bias_linear": False, "architectures": ["Zamba2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "conv_dimension": 4, "eos_token_id": 2, "expansion_factor": 2, "ffn_hidden_size": 8192, "hidden_size": 2048,
    "initializer_range": 0.02, "kv_channels": 64,
    "layers_block_type": (["m"] * 5 + ["g"]) * 6 + ["m"] * 2,
    "lora_rank": 128, "mamba_headdim": 64, "mamba_ngroups": 1, "max_position_embeddings": 4096,
    "model_type": "zamba2", "num_attention_heads": 32, "num_hidden_layers": 38, "num_key_value_heads": 32,
    "num_logits_to_keep": 1, "num_mem_blocks": 1, "num_query_groups": 32, "pad_token_id": 0, "rms_norm_eps": 1e-05,
    "rope_theta": 10000, "state_size": 128, "time_step_floor": 0.0001, "time_step_max": 0.1, "time_step_min": 0.001,
    "torch_dtype": "bfloat16", "use_cache": True, "use_mem_rope": True, "use_shared_attention_lora": True,
    "vocab_size": 32000,
}


def test_zamba2_fork_config_plans_as_the_transformers_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(ZAMBA2_FORK))
    fork, native = {}, {}
    for ctx in ("1k", "4k", "32k", "128k"):
        for m, got in ((p, fork), ("zamba2-1.2b", native)):
            code, out, err = invoke("plan", "-d", "h100", "-c", ctx, "-m", m, "--strategy", "hybrid", "--json")
            assert code == 0, err
            o = json.loads(out)["options"][0]
            got[ctx] = (o["bytes"]["state"], o["bytes"]["weights"])
    assert fork == native
    # and the shape is the checkpoint's: model.safetensors is 2.43 GB of bf16 (the HF file listing) = 1.215B parameters
    from edgekv.arch import arch_from_config
    assert abs(arch_from_config(ZAMBA2_FORK, "z", "config.json").n_params / 1.215e9 - 1) < 0.005
    # by hand: 6 hybrid layers keep K and V (32 KV heads x 128, fp16) per token; 38 Mamba-2 layers keep 64 heads x
    # 64 x d_state 128 fp32 and a 3-column fp32 conv state over 4096 + 2 x 128 channels, whatever the context
    recurrent = 38 * (64 * 64 * 128 * 4 + (4096 + 2 * 128) * 3 * 4)
    for ctx, n in (("1k", 1024), ("32k", 32768)):
        assert fork[ctx][0] == 6 * 2 * 32 * 128 * 2 * n + recurrent


def test_zamba2_fork_and_transformers_names_must_agree(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**ZAMBA2_FORK, "mamba_d_state": 64}))
    one_line_exit_2(*invoke("plan", "-d", "h100", "-c", "4k", "-m", p)[::2], "state_size")


# ---- the demo's output: the table, not what does not apply ----


def test_demo_says_what_does_not_apply_in_one_line_and_names_no_planned_model():
    code, out, err = invoke("plan", "-d", "pixel8", "-c", "32k")
    assert code == 0, err
    data = json.loads(invoke("plan", "-d", "pixel8", "-c", "32k", "--json")[1])
    planned = {o["model"] for o in data["options"]}
    rest = [e for e in data["not_applicable"] if "needs_family" not in e]
    assert len(rest) > 50  # kv, window, mla on every recurrent catalog model: what used to be a line each
    lines = out.splitlines()
    assert not [ln for ln in lines if "not applicable —" in ln]
    summary = [ln for ln in lines if "do not apply" in ln]
    assert len(summary) == 1 and f"{len(rest)} options do not apply" in summary[0] and "--all" in summary[0]
    for ln in lines:  # a family's "needs a model built that way" line names only models the table does not hold
        if "needs a model built that way" in ln:
            named = set(ln.split("catalog models: ", 1)[1].split(", "))
            assert not named & planned, ln


    # --all or --explain lists each one instead
    args = ("plan", "-d", "pixel8", "-c", "4k", "-m", "mamba-130m", "-m", "gemma-3-270m")
    data = json.loads(invoke(*args, "--json")[1])
    want = [e for e in data["not_applicable"] if "needs_family" not in e]
    assert len(want) == 6  # mamba-130m: kv, kv-int8, kv-int4, window, mla; gemma-3-270m's 4096 window covers 4k
    for flag in ("--all", "--explain"):
        code, out, err = invoke(*args, flag)
        assert code == 0, err
        assert len([ln for ln in out.splitlines() if "not applicable —" in ln]) == len(want)
        assert "do not apply" not in out


# ---- did you mean ----


@pytest.mark.parametrize("args,want", [
    (("plan", "-d", "pixle8", "-c", "4k"), "did you mean pixel8?"),
    (("plan", "-d", "Pixel8", "-c", "4k"), "did you mean pixel8?"),
    (("plan", "-d", "iphone15pro", "-c", "4k"), "did you mean iphone15-pro?"),
    (("plan", "-d", "pixel8", "-c", "4k", "-m", "llama3.2-1b"), "did you mean llama-3.2-1b?"),
    (("plan", "-d", "pixel8", "-c", "4k", "-m", "Qwen/Qwen2.5-0.5B"), "did you mean qwen2.5-0.5b?"),
    (("plan", "-d", "pixel8", "-c", "4k", "-m", "HuggingFaceTB/SmolLM2-135M"), "did you mean smollm2-135m?"),
    (("baseline", "-m", "Meta-Llama-3-70B"), "did you mean llama-3-70b?"),
])
def test_a_mistyped_name_gets_did_you_mean_in_one_short_line(args, want):
    code, out, err = invoke(*args)
    one_line_exit_2(code, err, want)
    assert len(err) < 300, err  # not the whole catalog


def test_nothing_close_is_not_guessed():
    code, out, err = invoke("plan", "-d", "pixel8", "-c", "4k", "-m", "gpt-5")
    one_line_exit_2(code, err, "unknown model 'gpt-5'")
    assert "did you mean" not in err and "edgekv models" in err


# ---- help ----


def test_help_summaries_are_whole_and_every_command_has_an_example():
    code, out, err = cli("--help", env={"COLUMNS": "80"})
    assert code == 0, err
    commands = out.split("Commands:", 1)[1]
    assert "..." not in commands
    assert max(len(ln) for ln in out.splitlines()) <= 80
    from edgekv.cli import main
    names = sorted(main.commands)
    assert {"plan", "export", "run", "profile", "report", "analyze", "ring"} <= set(names)
    for name in names:
        code, out, err = invoke(name, "--help")
        assert code == 0, err
        example = out.split("Example:", 1)[1].split("Options:", 1)[0].strip()
        assert example.startswith(f"edgekv {name}"), (name, out)


# ---- the plan's own speed (benchmarks/plan_speed.py measures it; these keep its causes away) ----


def test_the_demo_imports_no_numpy_nor_rich_and_builds_only_models_that_could_run():
    """Importing numpy, or rich and laying its tables out, cost the demo more CPU than its planning; building every
    catalog model (DeepSeek-V3's 45,000 weight tensors) to drop the ones that cannot run on a phone cost a third."""
    code = ("import sys, runpy, io, contextlib\n"
            "sys.argv = ['edgekv', 'plan', '--device', 'pixel8', '--ctx', '32k']\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        runpy.run_module('edgekv.cli', run_name='__main__')\n"
            "    except SystemExit:\n        pass\n"
            "from edgekv.arch import catalog_arch\n"
            "from edgekv.devices import load_device\n"
            "from edgekv.plan import default_models\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'rich', 'torch')))\n"
            "print(catalog_arch.cache_info().currsize, len(default_models(load_device('pixel8'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    heavy, built = p.stdout.strip().splitlines()[-2:]
    assert heavy == "[]", p.stdout[-500:] + p.stderr[-2000:]
    n_built, n_plausible = map(int, built.split())
    assert n_built == n_plausible < 35


def test_the_catalog_index_is_current_and_a_stale_entry_is_not_used(monkeypatch):
    """edgekv/arch/catalog_index.json holds what the planner would compute (`python -m edgekv.catalog_index`
    rewrites it); an entry whose catalog file changed is computed from the Arch instead."""
    from edgekv import catalog_index as ci
    from edgekv.arch import catalog_entry
    stored = json.loads(ci.INDEX.read_text())
    assert stored == json.loads(json.dumps(ci.build())), "stale: run python -m edgekv.catalog_index"
    # the parameter counts against the catalog's published ones (a model card's "1.2B", a file's bytes)
    for name, e in stored["models"].items():
        pub = catalog_entry(name).get("params", {}).get("published")
        if pub:
            assert abs(e["n_params"] / pub - 1) < 0.1, name
    ci.summary.cache_clear()
    monkeypatch.setattr(ci, "_stored", lambda: {"smollm2-135m": {**stored["models"]["smollm2-135m"],
                                                                  "file": "0" * 64, "int4_bytes": 1.0}})
    assert ci.summary("smollm2-135m")["int4_bytes"] == stored["models"]["smollm2-135m"]["int4_bytes"] != 1.0
    ci.summary.cache_clear()


# one catalog config per reader (edgekv.arch.READERS' families)
READER_SAMPLES = ("smollm2-135m", "gemma-3-270m", "deepseek-v2-lite", "mamba-130m", "mamba2-1.3b", "jamba-v0.1",
                  "falcon-h1-0.5b", "zamba2-1.2b", "rwkv-4-169m-pile", "lfm2-350m", "granite-4.0-h-350m",
                  "qwen3.5-0.8b", "phi-4-mini")


def _numeric_leaves(d: dict, path=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _numeric_leaves(v, path + (k,))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield path + (k,)
        elif isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            yield path + (k, 0)


@pytest.mark.parametrize("model", READER_SAMPLES)
def test_every_number_of_a_config_as_infinity_or_nan_is_planned_finite_or_refused_in_one_line(model):
    """transformers reads a bare Infinity / NaN anywhere in a config; edgekv reads it too, and then either plans
    with it (a field it does not use: finite numbers in the plan, never NaN) or refuses it as an EdgekvError naming
    the file, never a Python error."""
    import copy
    import math

    from edgekv.arch import arch_from_config, catalog_entry
    from edgekv.devices import load_device
    from edgekv.jsonfile import finite
    from edgekv.plan import make_plan
    base = catalog_entry(model)["config"]
    dev = load_device("pixel8")
    for path in _numeric_leaves(base):
        for value in (math.inf, math.nan):
            cfg = copy.deepcopy(base)
            d = cfg
            for k in path[:-1]:
                d = d[k]
            d[path[-1]] = value
            try:
                plan = make_plan(dev, 32768, [arch_from_config(cfg, model, "config.json")])
            except EdgekvError as e:
                assert str(e).startswith("config.json"), (path, value, e)
                continue
            assert finite(plan.to_json(explain=True)), (path, value)
