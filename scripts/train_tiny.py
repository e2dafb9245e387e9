#!/usr/bin/env python
"""Train the tiny byte-level fixtures in fixtures/tiny/: Mamba-1, Mamba-2, RWKV-4 (linear attention) and Llama.

Each is a standard transformers model (MambaForCausalLM, Mamba2ForCausalLM, RwkvForCausalLM, LlamaForCausalLM)
with a tiny config of about 1.8M parameters, trained from scratch on the bytes of the Python standard library's
source (every *.py under sysconfig.get_paths()["stdlib"], site-packages excluded; pydoc_data/topics.py, which holds
the text of the Python reference docs, is among them). Tokens are bytes: vocab_size 256, token id == byte value,
bos/eos/pad id 0 (the NUL byte, which never occurs in the data); there is no tokenizer.

    python scripts/train_tiny.py --model all                 # reproduces fixtures/tiny/{mamba,mamba2,rwkv,llama}
    python scripts/train_tiny.py --model mamba2 --steps 50 --out /tmp/tiny   # a quick try
    python scripts/train_tiny.py --model llama --recall-mix 0.5 --seq 512 --out fixtures/tiny-recall   # recall fixtures

--recall-mix F (default 0: the fixtures in fixtures/tiny/, unchanged) makes a fraction F of the training windows
associative-recall windows (recall_window below): stdlib text with a few `name = "value"` lines inserted, each later
repeated, so that the value can only be predicted by copying it from the earlier line. The format deliberately differs
from the recall probe's (edgekv/analyze/recall.py: `key_` + 4 hex digits, 6 values of [a-z0-9], double quotes):
names are random identifiers never starting with `key_`, values 3-10 characters of [A-Za-z0-9], quoted with ' or "
or written `name: value`. --seq sets the training window length (default 256) so the copy distance can grow; the
validation windows and the test slice stay 256 bytes so bits/byte stay comparable with fixtures/tiny/.

GPU and longer runs (scripts/gpu_recall.sh uses these; none changes the defaults above):
--device cuda; --batch N (default 8); --time-budget SECONDS stops the training loop cleanly, then evaluates and
saves as usual (the lr's cosine decay follows the larger of the step and time fractions, and a checkpoint is saved at
every evaluation, marked "partial" in the log until the run finishes); --warmup STEPS; --copy-weight W adds W x the
mean cross-entropy on the recall windows' copy targets to the loss (a denser copying signal; the logged train
bits/byte stay the plain next-byte loss); --workers N builds batches in N forked processes, each batch from a
generator seeded by (seed, step), so the result does not depend on N; --eval-every / --log-every.

    python scripts/train_tiny.py --model llama --device cuda --seq 512 --recall-mix 0.75 --copy-weight 1 \
        --batch 64 --lr 1.5e-3 --warmup 200 --steps 1000000 --time-budget 210 --workers 4 --out /tmp/tiny-recall

Writes <out>/<model>/ with config.json + model.safetensors (save_pretrained, fp32) and train_log.json (loss curve,
validation bits/byte, wall time, parameter count, config, data description, versions). Deterministic given the
same stdlib, torch and thread count (seeded init, seeded windows).

CPU notes. One thread by default (--threads): on a shared 2-core machine two OpenMP threads are often 10-20x slower
for the recurrent models' small per-time-step ops. transformers' Mamba-1 CPU path (no mamba_ssm kernels) runs its
selective scan as a Python loop whose backward re-materialises the whole (batch, d_inner, seq, state) tensor at every
time step; while *training* only, this script swaps in an equivalent scan (same recurrence, unbind instead of
indexing) that is ~20x faster to backpropagate, after checking on the model itself that it matches the stock path
(max |logit diff| < 1e-4; measured 7e-6). The saved fixture is an ordinary MambaForCausalLM and every evaluation
(validation, tests) uses the stock transformers code.
"""

from __future__ import annotations

import argparse
import base64
import collections
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

MODELS = ("mamba", "mamba2", "rwkv", "llama")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "fixtures" / "tiny"

SEQ_LEN = 256
BATCH = 8
VAL_WINDOWS = 32  # fixed validation windows of SEQ_LEN + 1 bytes
EVAL_SLICE_BYTES = 2048  # the slice tests/test_fixtures.py scores (as 8 rows of 256)
LONG_EVAL_BYTES = 4096  # one held-out sequence scored past the training length, for the record

# Per-model defaults: the same data for every model (400 steps x 8 x 256 = 819,200 training bytes); each model's
# training time is in its train_log.json and fixtures/README.md.
DEFAULTS = {
    "llama": dict(steps=400, lr=3e-3),
    "mamba2": dict(steps=400, lr=3e-3),
    "rwkv": dict(steps=400, lr=3e-3),
    "mamba": dict(steps=400, lr=3e-3),
}
RUN_ORDER = ("llama", "mamba2", "rwkv", "mamba")  # fastest first
SEED = 1234
BOS = EOS = PAD = 0  # NUL byte: valid token id, absent from the data

RECALL_NAME_HEAD = b"abcdefghijklmnopqrstuvwxyz"
RECALL_NAME_TAIL = b"abcdefghijklmnopqrstuvwxyz0123456789_"
RECALL_VALUE = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
RECALL_FORMATS = ('{k} = "{v}"\n', "{k} = '{v}'\n", "{k}: {v}\n")
RECALL_VAL_WINDOWS = 16  # fixed recall windows (seed SEED + 2) whose copied-value accuracy is logged


# ----------------------------------------------------------------------------------------------------------- data
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[tuple[str, Path]]:
    root = stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in p.relative_to(root).parts or "__pycache__" in rel:
            continue
        if p.is_file():
            out.append((rel, p))
    out.sort(key=lambda t: t[0])
    return out


def is_validation(rel: str) -> bool:
    """Deterministic ~5% of files by a hash of the path; the docs file always trains."""
    if rel == "pydoc_data/topics.py":
        return False
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 20 == 0


def load_data():
    train, val, val_files = [], [], []
    n_train = 0
    for rel, p in stdlib_files():
        b = p.read_bytes()
        if is_validation(rel):
            val.append(b)
            val_files.append((rel, len(b)))
        else:
            train.append(b)
            n_train += 1
    tr = np.frombuffer(b"".join(train), dtype=np.uint8)
    va = np.frombuffer(b"".join(val), dtype=np.uint8)
    desc = {
        "source": "Python standard library source: every *.py under sysconfig.get_paths()['stdlib'] "
        "(site-packages excluded), sorted by relative path, raw bytes, concatenated; includes "
        "pydoc_data/topics.py (the reference docs' text), which is always in the training split",
        "stdlib": str(stdlib_root()),
        "python": platform.python_version(),
        "split": "validation = files with int(sha256(relative path)) % 20 == 0",
        "train_files": n_train,
        "val_files": len(val_files),
        "train_bytes": int(tr.size),
        "val_bytes": int(va.size),
        "train_sha256": hashlib.sha256(tr.tobytes()).hexdigest(),
        "val_sha256": hashlib.sha256(va.tobytes()).hexdigest(),
        "tokens": "bytes: token id == byte value, vocab 256; bos/eos/pad = 0 (NUL, absent from the data)",
    }
    return tr, va, val_files, desc


def eval_slice_spec(val_files) -> dict:
    """The fixed held-out slice the tests score: bytes [4096, 6144) of the first validation file >= 16 KB."""
    rel = next(r for r, n in val_files if n >= 16384)
    b = (stdlib_root() / rel).read_bytes()[4096 : 4096 + EVAL_SLICE_BYTES]
    return {
        "file": rel,
        "offset": 4096,
        "length": EVAL_SLICE_BYTES,
        "sha256": hashlib.sha256(b).hexdigest(),
        "bytes_b64": base64.b64encode(b).decode(),
        "scored_as": f"{EVAL_SLICE_BYTES // SEQ_LEN} independent rows of {SEQ_LEN} bytes, {SEQ_LEN - 1} predictions each",
    }


# ---------------------------------------------------------------------------------------------------------- models
def make_config(name: str):
    from transformers import LlamaConfig, Mamba2Config, MambaConfig, RwkvConfig

    common = dict(vocab_size=256, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    if name == "mamba":
        # d_inner 512, state 16, dt_rank 16
        return MambaConfig(hidden_size=256, state_size=16, num_hidden_layers=4, expand=2, conv_kernel=4,
                           tie_word_embeddings=True, use_mambapy=False, **common)
    if name == "mamba2":
        # hidden*expand = 512 = num_heads 8 * head_dim 64; one group; state 64
        return Mamba2Config(hidden_size=256, state_size=64, num_hidden_layers=4, expand=2, head_dim=64,
                            num_heads=8, n_groups=1, conv_kernel=4, chunk_size=64, tie_word_embeddings=True,
                            **common)
    if name == "rwkv":
        # RWKV-4; rescale_every 0 so eval-mode weights equal the trained ones; context_length only sizes the CUDA
        # kernel (the recurrence itself has no length limit)
        return RwkvConfig(hidden_size=192, num_hidden_layers=4, attention_hidden_size=192, intermediate_size=640,
                          context_length=8192, rescale_every=0, tie_word_embeddings=False, **common)
    if name == "llama":
        return LlamaConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=4, max_position_embeddings=8192,
                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                           tie_word_embeddings=True, **common)
    raise ValueError(name)


def model_class(name: str):
    import transformers

    return {
        "mamba": transformers.MambaForCausalLM,
        "mamba2": transformers.Mamba2ForCausalLM,
        "rwkv": transformers.RwkvForCausalLM,
        "llama": transformers.LlamaForCausalLM,
    }[name]


def model_device(model):
    return next(model.parameters()).device


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def bits_per_byte(model, rows) -> float:
    """Mean next-byte cross-entropy in bits over rows (int64 tensor [n, L]); stock forward, no grad."""
    import torch
    import torch.nn.functional as F

    model.eval()
    rows = rows.to(model_device(model))
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    return float(nll) / math.log(2)


def slice_rows(b: bytes):
    import torch

    a = torch.tensor(list(b), dtype=torch.long)
    return a.view(-1, SEQ_LEN)


def recall_window(tr: np.ndarray, seq: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One associative-recall training window -> (bytes uint8 [seq + 1], mask bool [seq]: True where target byte
    i + 1 is a value byte of a repeated line, i.e. only predictable by copying).

    k = 1..6 lines `name = "value"` (format drawn from RECALL_FORMATS per line; name: 1 letter + 2-7 of
    [a-z0-9_], never `key_...`; value: 3-10 of RECALL_VALUE) are inserted at line starts of a run of stdlib text,
    then every line is repeated once, in shuffled order, at later line starts: the distance from a line to its
    repeat runs from 0 to about seq bytes."""
    k = int(rng.integers(1, 7))
    lines, spans = [], []
    for _ in range(k):
        while True:
            name = bytes([rng.choice(list(RECALL_NAME_HEAD))]) + bytes(
                rng.choice(list(RECALL_NAME_TAIL), size=int(rng.integers(2, 8))).tolist())
            if not name.startswith(b"key_"):
                break
        value = bytes(rng.choice(list(RECALL_VALUE), size=int(rng.integers(3, 11))).tolist()).decode()
        line = RECALL_FORMATS[int(rng.integers(len(RECALL_FORMATS)))].format(k=name.decode(), v=value).encode()
        lines.append(line)
        spans.append(len(line) - len(value) - (1 if line.endswith(b": " + value.encode() + b"\n") else 2))
    budget = max(16, seq + 1 - 2 * sum(len(x) for x in lines))
    st = int(rng.integers(0, tr.size - budget - 1))
    text = tr[st:st + budget]
    nls = np.flatnonzero(text == 10) + 1
    cuts = np.sort(rng.choice(nls, 2 * k, replace=nls.size < 2 * k) if nls.size else rng.integers(0, budget, 2 * k))
    order = list(range(k)) + [int(i) for i in rng.permutation(k)]  # all lines, then their repeats
    out, mask, prev = [], [], 0
    for j, (c, i) in enumerate(zip(cuts.tolist(), order)):
        out.append(text[prev:c])
        mask.append(np.zeros(c - prev, bool))
        line = np.frombuffer(lines[i], np.uint8)
        m = np.zeros(line.size, bool)
        if j >= k:  # a repeat: its value bytes (not the closing quote / line break) are the copy targets
            m[spans[i]:spans[i] + len(lines[i]) - spans[i] - (2 if lines[i].endswith((b'"\n', b"'\n")) else 1)] = True
        out.append(line)
        mask.append(m)
        prev = c
    out.append(text[prev:])
    mask.append(np.zeros(budget - prev, bool))
    w, m = np.concatenate(out)[:seq + 1], np.concatenate(mask)[:seq + 1]
    if w.size < seq + 1:  # only when the inserted lines overflow a tiny budget: pad with more text
        w = np.concatenate([w, tr[st + budget:st + budget + seq + 1 - w.size]])
        m = np.concatenate([m, np.zeros(seq + 1 - m.size, bool)])
    return w, m[1:]


def recall_accuracy(model, rows, masks) -> float:
    """Top-1 accuracy on the copied value bytes of recall windows (rows int64 [n, L + 1], masks bool [n, L])."""
    import torch

    model.eval()
    rows, masks = rows.to(model_device(model)), masks.to(model_device(model))
    with torch.no_grad():
        pred = model(input_ids=rows[:, :-1]).logits.argmax(-1)
    return float((pred == rows[:, 1:])[masks].float().mean())


_WORKER_TRAIN = None  # the training bytes, inherited by forked batch workers


def _worker_init(tr):
    global _WORKER_TRAIN
    _WORKER_TRAIN = tr


def make_batch(args) -> tuple[np.ndarray, np.ndarray]:
    """One training batch drawn from its own generator, seeded by (seed, step), so the batches do not depend on the
    number of workers or on the order they finish in -> (bytes uint8 [batch, seq + 1], copy mask bool [batch, seq]).
    Each row is a recall window with probability recall_mix, else a text window at a uniform random offset."""
    step, batch, seq, recall_mix, seed = args
    tr = _WORKER_TRAIN
    r = np.random.default_rng([seed, step])
    rows, masks = [], []
    for _ in range(batch):
        if recall_mix and r.random() < recall_mix:
            w, m = recall_window(tr, seq, r)
        else:
            s = int(r.integers(0, tr.size - seq - 1))
            w, m = tr[s:s + seq + 1], np.zeros(seq, bool)
        rows.append(w)
        masks.append(m)
    return np.stack(rows), np.stack(masks)


# ------------------------------------------------------------------------------------- Mamba-1 training-only scan
def _train_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                          return_last_state=False, **kwargs):
    """Same maths as transformers' mamba_selective_scan recurrent branch; unbind() instead of per-step indexing
    so that backward is a single stack rather than one full-size zero tensor per time step."""
    import torch
    import torch.nn.functional as F

    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B = B.transpose(1, 2)  # [b, L, n]
    C = C.transpose(1, 2)
    dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [b, d, L, n]
    dBu = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    h = torch.zeros(hidden_states.shape[0], hidden_states.shape[1], A.shape[-1], dtype=input_dtype,
                    device=hidden_states.device)
    hs = []
    for a_t, b_t in zip(dA.unbind(2), dBu.unbind(2)):
        h = a_t * h + b_t
        hs.append(h)
    states = torch.stack(hs, dim=2)  # [b, d, L, n]
    y = (states.to(input_dtype) * C[:, None, :, :]).sum(-1)
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    if return_last_state:
        return y, h
    return y


class _patched_mamba_scan:
    def __enter__(self):
        import transformers.models.mamba.modeling_mamba as mm

        self.mm, self.orig = mm, mm.mamba_selective_scan
        mm.mamba_selective_scan = _train_selective_scan

    def __exit__(self, *exc):
        self.mm.mamba_selective_scan = self.orig


# ------------------------------------------------------------------------------------------------------- training
def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    p = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def lr_budget(step: int, warm: int, progress: float, peak: float) -> float:
    """The same shape as lr_at with an explicit warmup (steps) and the decay driven by progress in [0, 1] (the larger
    of the step fraction and the time-budget fraction), so a run stopped by its time budget ends decayed."""
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress)))))


def train_one(name: str, steps: int, lr: float, out: Path, data, threads: int, seq: int = SEQ_LEN,
              recall_mix: float = 0.0, batch: int = BATCH, device: str = "cpu", time_budget: float | None = None,
              warmup: int | None = None, copy_weight: float = 0.0, workers: int = 0, eval_every: int | None = None,
              log_every: int = 10) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers

    tr, va, val_files, desc = data
    cpu0 = time.process_time()
    pool = None
    if workers:  # forked before anything touches the GPU; the workers only run numpy
        import multiprocessing

        pool = multiprocessing.get_context("fork").Pool(workers, initializer=_worker_init, initargs=(tr,))
    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    dev = torch.device(device)
    if dev.type == "cuda":  # fp32 weights and optimizer; matmuls in TF32 on the GPU
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = make_config(name)
    model = model_class(name)(cfg).float()
    n_params = count_params(model)
    budget_mode = time_budget is not None or warmup is not None  # the original step schedule otherwise
    warm = warmup if warmup is not None else max(1, steps // 20)
    print(f"[{name}] {n_params:,} parameters, {steps} steps x {batch}x{seq} bytes, lr {lr}"
          + (f", recall mix {recall_mix}" if recall_mix else "")
          + (f", copy weight {copy_weight}" if copy_weight else "")
          + (f", time budget {time_budget:.0f}s" if time_budget is not None else "")
          + f", device {dev}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
          flush=True)

    rng = np.random.default_rng(SEED)
    vrng = np.random.default_rng(SEED + 1)
    vstarts = vrng.integers(0, va.size - SEQ_LEN - 1, size=VAL_WINDOWS)
    val_rows = torch.from_numpy(np.stack([va[s : s + SEQ_LEN + 1] for s in vstarts]).astype(np.int64))
    spec = eval_slice_spec(val_files)
    slice_b = base64.b64decode(spec["bytes_b64"])
    if recall_mix:  # a separate generator, so the text windows' stream is the one recall_mix 0 draws
        mrng = np.random.default_rng(SEED + 3)
        rvrng = np.random.default_rng(SEED + 2)
        rv = [recall_window(va, seq, rvrng) for _ in range(RECALL_VAL_WINDOWS)]  # held-out text, fresh lines
        rv_rows = torch.from_numpy(np.stack([w for w, _ in rv]).astype(np.int64))
        rv_masks = torch.from_numpy(np.stack([m for _, m in rv]))

    scan_check = None
    ctx = _patched_mamba_scan() if name == "mamba" else None
    if ctx is not None:  # verify the training scan against the stock path on this very model
        x = val_rows[:4, :128]
        model.eval()
        with torch.no_grad():
            ref = model(input_ids=x).logits
            with _patched_mamba_scan():
                alt = model(input_ids=x).logits
        scan_check = float((ref - alt).abs().max())
        print(f"[mamba] training scan vs stock path: max |logit diff| {scan_check:.2e}", flush=True)
        assert scan_check < 1e-4, scan_check
    model.to(dev)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if dev.type == "cuda" else {}))

    log = {
        "model": name,
        "class": type(model).__name__,
        "params": n_params,
        "config": cfg.to_dict(),
        "data": desc,
        "training": {
            "steps": steps, "batch": batch, "seq_len": seq, "optimizer": "AdamW(betas=(0.9,0.95), "
            "weight_decay=0.1 on matrices, 0 on vectors/embeddings)", "lr_peak": lr,
            "schedule": "linear warmup 5% of steps, cosine decay to 10% of peak", "grad_clip": 1.0, "seed": SEED,
            "windows": "uniform random start offsets into the concatenated training bytes",
            "threads": threads, "dtype": "float32",
            "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)}, TF32 matmuls)" if dev.type == "cuda" else ""),
            "mamba_training_scan": None if scan_check is None else
            f"equivalent unbind-based selective scan while training; max |logit diff| vs stock {scan_check:.2e}",
        },
        "validation": f"{VAL_WINDOWS} fixed windows of {SEQ_LEN + 1} bytes from the held-out files "
                      f"(seed {SEED + 1}); bits/byte = mean next-byte cross-entropy / ln 2",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "train_curve": {"step": [], "bits_per_byte": [], "wall_s": []},
        "val_curve": {"step": [], "bits_per_byte": [], "wall_s": []},
    }
    if recall_mix:
        log["training"]["recall_mix"] = {
            "fraction": recall_mix,
            "windows": "per batch row, with probability fraction (own generator, seed SEED + 3) the row is a "
                       "recall window instead of a text window; see recall_window in scripts/train_tiny.py",
            "format": "k = 1..6 lines inserted at line starts of stdlib text, each repeated once later in shuffled "
                      "order; line formats " + ", ".join(repr(f) for f in RECALL_FORMATS) + "; name: one of [a-z] then "
                      "2-7 of [a-z0-9_], never 'key_...'; value: 3-10 of [A-Za-z0-9]",
            "differs_from_probe": "the recall probe (edgekv/analyze/recall.py) uses key_ + 4 hex digits, exactly 6 "
                                  "value characters of [a-z0-9] and double quotes; none of its needles can occur here",
        }
        log["recall_val"] = (f"{RECALL_VAL_WINDOWS} fixed recall windows of {seq + 1} bytes built on the held-out "
                             f"text (seed {SEED + 2}); accuracy = top-1 on the repeated lines' value bytes")
        log["recall_val_curve"] = {"step": [], "accuracy": [], "wall_s": []}
    if budget_mode:
        log["training"]["schedule"] = (f"linear warmup {warm} steps, then cosine decay to 10% of peak over the "
                                       "larger of the step fraction and the time-budget fraction")
        log["training"]["time_budget_s"] = time_budget
    if copy_weight:
        log["training"]["copy_weight"] = (f"loss = mean next-byte cross-entropy + {copy_weight} x mean cross-entropy "
                                          "on the copy-target bytes (the repeated lines' values); the logged train "
                                          "bits/byte are the first term only")
    if workers:
        log["training"]["batches"] = (f"make_batch in {workers} forked workers: each batch from its own generator "
                                      f"seeded (SEED + 3, step)")
    d = out / name
    d.mkdir(parents=True, exist_ok=True)

    def write_log():
        (d / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")

    init_val = bits_per_byte(model, val_rows)
    log["val_curve"]["step"].append(0)
    log["val_curve"]["bits_per_byte"].append(round(init_val, 4))
    log["val_curve"]["wall_s"].append(0.0)
    print(f"[{name}] step 0 val {init_val:.3f} bits/byte", flush=True)
    if recall_mix:
        log["recall_val_curve"]["step"].append(0)
        log["recall_val_curve"]["accuracy"].append(round(recall_accuracy(model, rv_rows, rv_masks), 4))
        log["recall_val_curve"]["wall_s"].append(0.0)

    val_every = eval_every or max(10, steps // 8)
    pending = collections.deque()  # batches being built by the workers, at most 4 per worker ahead of the loop

    def submit(i):
        if pool is not None and i < steps:
            pending.append(pool.apply_async(make_batch, ((i, batch, seq, recall_mix, SEED + 3),)))

    for i in range(4 * workers):
        submit(i)
    t0 = time.time()
    t_warm = None  # wall time at the end of warmup (budget mode)
    acc, nacc = 0.0, 0
    acc_t = torch.zeros((), device=dev)
    stopped_by = "steps"
    for step in range(steps):
        model.train()
        el = time.time() - t0
        if budget_mode:
            prog = 0.0
            if step >= warm:
                if t_warm is None:
                    t_warm = el
                prog = (step - warm) / max(1, steps - warm)
                if time_budget is not None:
                    prog = max(prog, (el - t_warm) / max(1e-9, time_budget - t_warm))
            cur_lr = lr_budget(step, warm, prog, lr)
        else:
            cur_lr = lr_at(step, steps, lr)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        if pool is not None:
            xs, ms = pending.popleft().get()
            submit(step + 4 * workers)
            xb = torch.from_numpy(xs.astype(np.int64))
            mb = torch.from_numpy(ms)
        else:
            starts = rng.integers(0, tr.size - seq - 1, size=batch)
            rows = [tr[s : s + seq + 1] for s in starts]
            masks = [np.zeros(seq, bool) for _ in rows]
            if recall_mix:
                for i in range(len(rows)):
                    if mrng.random() < recall_mix:
                        rows[i], masks[i] = recall_window(tr, seq, mrng)
            xb = torch.from_numpy(np.stack(rows).astype(np.int64))
            mb = torch.from_numpy(np.stack(masks))
        xb = xb.to(dev, non_blocking=True)
        if ctx is not None:
            with ctx:
                logits = model(input_ids=xb[:, :-1]).logits
        else:
            logits = model(input_ids=xb[:, :-1]).logits
        if copy_weight:
            nll = F.cross_entropy(logits.float().reshape(-1, 256), xb[:, 1:].reshape(-1), reduction="none")
            loss = nll.mean()
            mflat = mb.to(dev, non_blocking=True).reshape(-1).float()
            total = loss + copy_weight * (nll * mflat).sum() / mflat.sum().clamp(min=1.0)
        else:
            loss = total = F.cross_entropy(logits.float().reshape(-1, 256), xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if dev.type == "cpu":
            acc += loss.item() / math.log(2)
        else:  # no host sync per step
            acc_t += loss.detach()
        nacc += 1
        done = step + 1
        over = time_budget is not None and time.time() - t0 >= time_budget
        if over:
            stopped_by = "time budget"
        if done % log_every == 0 or done == steps or over:
            if dev.type != "cpu":
                acc, acc_t = float(acc_t) / math.log(2), torch.zeros((), device=dev)
            el = time.time() - t0
            log["train_curve"]["step"].append(done)
            log["train_curve"]["bits_per_byte"].append(round(acc / nacc, 4))
            log["train_curve"]["wall_s"].append(round(el, 1))
            msg = f"[{name}] step {done}/{steps} train {acc / nacc:.3f} bits/byte"
            if budget_mode:
                msg += f" lr {cur_lr:.2e}"
            acc, nacc = 0.0, 0
            if done % val_every == 0 or done == steps or over:
                v = bits_per_byte(model, val_rows)
                log["val_curve"]["step"].append(done)
                log["val_curve"]["bits_per_byte"].append(round(v, 4))
                log["val_curve"]["wall_s"].append(round(time.time() - t0, 1))
                msg += f"  val {v:.3f}"
                if recall_mix:
                    ra = recall_accuracy(model, rv_rows, rv_masks)
                    log["recall_val_curve"]["step"].append(done)
                    log["recall_val_curve"]["accuracy"].append(round(ra, 4))
                    log["recall_val_curve"]["wall_s"].append(round(time.time() - t0, 1))
                    msg += f"  recall {ra:.3f}"
                if time_budget is not None:  # a checkpoint, so a run killed later still leaves a model
                    log["partial"] = f"checkpoint at step {done}; final evaluation not reached"
                    model.save_pretrained(d, safe_serialization=True)
                write_log()
            eta = (time.time() - t0) / done * (steps - done)
            if time_budget is not None:
                eta = min(eta, max(0.0, time_budget - (time.time() - t0)))
            print(f"{msg}  {el:.0f}s elapsed, ETA {eta:.0f}s", flush=True)
        if over:
            break
    wall = time.time() - t0
    if pool is not None:
        pool.terminate()
    log.pop("partial", None)
    if budget_mode:
        log["training"]["steps_done"] = done
        log["training"]["stopped_by"] = stopped_by

    # final numbers with the stock forward: held-out windows, the test slice, and a long held-out sequence
    final_val = log["val_curve"]["bits_per_byte"][-1]
    slice_bpb = bits_per_byte(model, slice_rows(slice_b))
    spec["bits_per_byte"] = round(slice_bpb, 4)
    long_rel = next(r for r, n in val_files if n >= LONG_EVAL_BYTES + 1024 and r != spec["file"])
    lb = (stdlib_root() / long_rel).read_bytes()[:LONG_EVAL_BYTES + 1]
    lrow = torch.tensor(list(lb), dtype=torch.long, device=dev)[None]
    model.eval()
    with torch.no_grad():
        lg = model(input_ids=lrow[:, :-1]).logits.float()[0]
        nll = F.cross_entropy(lg, lrow[0, 1:], reduction="none") / math.log(2)
    buckets = [(0, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096)]
    log["long_sequence_eval"] = {
        "file": long_rel, "bytes": LONG_EVAL_BYTES,
        "note": f"one sequence, positions past the training length {seq} included",
        "bits_per_byte_by_position": {f"{a}-{b}": round(float(nll[a:b].mean()), 4) for a, b in buckets},
    }
    log["eval_slice"] = spec
    log["final"] = {"val_bits_per_byte": final_val, "eval_slice_bits_per_byte": round(slice_bpb, 4),
                    **({"recall_val_accuracy": log["recall_val_curve"]["accuracy"][-1]} if recall_mix else {}),
                    "train_wall_s": round(wall, 1),
                    "cpu_s": round(time.process_time() - cpu0, 1)}
    model.save_pretrained(d, safe_serialization=True)
    write_log()
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"[{name}] done: val {final_val:.3f} bits/byte, test slice {slice_bpb:.3f}, {wall:.0f}s, "
          f"folder {size / 1e6:.2f} MB, long-seq {log['long_sequence_eval']['bits_per_byte_by_position']}",
          flush=True)
    return log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=MODELS + ("all",))
    ap.add_argument("--steps", type=int, default=None, help="override the per-model default step count")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=SEQ_LEN, help=f"training window length in bytes (default {SEQ_LEN})")
    ap.add_argument("--recall-mix", type=float, default=0.0, metavar="F",
                    help="fraction of training windows that are associative-recall windows (default 0)")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"windows per step (default {BATCH})")
    ap.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="stop the training loop after this many seconds (the lr decay follows it), then evaluate "
                         "and save as usual; saves a checkpoint at every evaluation")
    ap.add_argument("--warmup", type=int, default=None, metavar="STEPS",
                    help="linear warmup steps (default 5%% of --steps)")
    ap.add_argument("--copy-weight", type=float, default=0.0, metavar="W",
                    help="add W x the mean cross-entropy on recall windows' copy targets to the loss (default 0)")
    ap.add_argument("--workers", type=int, default=0,
                    help="build batches in this many forked processes (default 0: in the loop, the original stream)")
    ap.add_argument("--eval-every", type=int, default=None, metavar="STEPS",
                    help="validation (and recall accuracy) every STEPS steps (default steps / 8)")
    ap.add_argument("--log-every", type=int, default=10, metavar="STEPS")
    a = ap.parse_args(argv)
    if not 0.0 <= a.recall_mix <= 1.0 or a.seq < 64:
        ap.error("--recall-mix must be in [0, 1] and --seq at least 64")
    if a.batch < 1 or a.workers < 0 or a.log_every < 1 or (a.eval_every is not None and a.eval_every < 1):
        ap.error("--batch, --log-every and --eval-every must be positive, --workers non-negative")
    if (a.time_budget is not None and a.time_budget <= 0) or a.copy_weight < 0 or (a.warmup is not None and a.warmup < 1):
        ap.error("--time-budget and --warmup must be positive, --copy-weight non-negative")
    if a.copy_weight and not a.recall_mix:
        ap.error("--copy-weight needs --recall-mix (the copy targets are in the recall windows)")
    if a.device != "cpu":
        import torch

        try:
            ok = torch.device(a.device).type == "cuda" and torch.cuda.is_available()
        except RuntimeError:
            ok = False
        if not ok:
            ap.error(f"--device {a.device}: no such device here (torch.cuda.is_available() is "
                     f"{torch.cuda.is_available()})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = RUN_ORDER if a.model == "all" else (a.model,)
    t = time.time()
    data = load_data()
    print(f"data: {data[3]['train_files']} train files ({data[3]['train_bytes']:,} bytes), "
          f"{data[3]['val_files']} validation files ({data[3]['val_bytes']:,} bytes), {time.time() - t:.1f}s",
          flush=True)
    for n in names:
        dflt = DEFAULTS[n]
        train_one(n, a.steps or dflt["steps"], a.lr or dflt["lr"], a.out, data, a.threads, a.seq, a.recall_mix,
                  batch=a.batch, device=a.device, time_budget=a.time_budget, warmup=a.warmup,
                  copy_weight=a.copy_weight, workers=a.workers, eval_every=a.eval_every, log_every=a.log_every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
