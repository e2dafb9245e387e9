"""Bytes, bandwidth, throughput, concurrency and cost: pure functions, no torch, no I/O beyond the cost data files.

Every function returns numbers together with the formula that produced them (an `Item`), so `--explain` can print
exactly what the planner computed. Units: bytes (int), seconds, FLOP, FLOP/s, bytes/s.

Modules: item (Item), costs (the runtimes' cost models from edgekv/costs/*.json, kv_read, fused_gqa), weights
(weight bytes), workspace (a call's transient memory, the runtime's load bytes), speed (a decode step's FLOP, bytes
and seconds, the attention kernels' stored rates), prefill (a prompt's FLOP as its graph computes them, and its
seconds), dollars (users per GPU, $ per M tokens), deployment (Deployment).
"""
import json
from pathlib import Path

from .costs import (ET_SDPA, GQA, KV_READ, MEASURED, MLA_REBUILD_COPIES, PLAN_RUNTIMES, RUNTIMES, SCAN_COPIES,
                    UNPACK_EXTRA_COPIES, WHERE_WRITTEN_TYPES, _rt, _traits, cache_key, fused_gqa, kv_read)
from .deployment import WEIGHT_PRECISIONS, Deployment
from .dollars import usd_per_m_tokens, users_per_gpu
from .item import Item
from .prefill import prefill_at_rates, prefill_flops, prefill_parts, prefill_seconds
from .speed import (ATTENTION_RATES, _attn_tokens, attention_flops, attention_kind, attention_rates, attention_seconds, cache_kind,
                    decode_flops, gguf_type_mix, decode_read_bytes, decode_tokens_per_s, decode_with_attention, layout_rank,
                    PTE_INT8_KERNELS, prefill_kind)
from .weights import (CARRIED_FORM, GGUF_CARRIED, _scheme_bytes, carried_form_name, carried_matrices,
                      carried_matrix_bytes, gathered_bytes, weight_bytes, weight_bytes_one)
from .workspace import (_kernel_code, _largest_packed, _layer_scratch, _tied_bytes, paged_table,
                        runtime_load_bytes, workspace_bytes)

# What a runtime's arm64 kernels pack beyond its x86 kernels, as a fraction of the stored weights, by cost model and
# weight precision: `edgekv profile --arch arm64` measurements (edgekv/costs/arm64_packing.json, {value, source}).
# Here, not in a submodule, so that a test can replace it on edgekv.memory.
ARM64_PACKING = {k: v for k, v in json.loads((Path(__file__).resolve().parent.parent / "costs" / "arm64_packing.json")
                                             .read_text()).items() if not k.startswith("_")}


def arm64_load(load: Item, weights_stored: float, runtime: str, precision: str) -> Item:
    """The runtime's load bytes on an arm64 device (a phone): plus the packing measured on arm64 where it differs."""
    f = ARM64_PACKING.get(runtime, {}).get(precision)
    if not f:
        return load
    extra = f["value"] * weights_stored
    return Item(load.value + extra, f"{load.formula} + arm64 packing {f['value']:+.4f} x stored weights "
                                    f"{weights_stored:,.0f} = {extra:+,.0f} B ({f['source']})")


__all__ = ["ARM64_PACKING", "arm64_load", "ET_SDPA", "GQA", "KV_READ", "MEASURED", "MLA_REBUILD_COPIES", "PLAN_RUNTIMES", "RUNTIMES", "SCAN_COPIES",
           "UNPACK_EXTRA_COPIES", "WHERE_WRITTEN_TYPES", "_rt", "_traits", "cache_key", "fused_gqa", "kv_read",
           "WEIGHT_PRECISIONS", "Deployment", "usd_per_m_tokens", "users_per_gpu", "Item", "_attn_tokens",
           "decode_flops", "decode_read_bytes", "decode_tokens_per_s", "layout_rank", "prefill_flops",
           "ATTENTION_RATES", "attention_flops", "attention_kind", "attention_rates", "attention_seconds", "cache_kind",
           "prefill_at_rates", "prefill_kind", "prefill_parts", "gguf_type_mix", "PTE_INT8_KERNELS",
           "decode_with_attention",
           "prefill_seconds", "_scheme_bytes", "CARRIED_FORM", "GGUF_CARRIED", "carried_matrix_bytes",
           "carried_form_name", "carried_matrices",
           "gathered_bytes", "weight_bytes", "weight_bytes_one", "_kernel_code", "_largest_packed",
           "_layer_scratch", "_tied_bytes", "paged_table", "runtime_load_bytes", "workspace_bytes"]
