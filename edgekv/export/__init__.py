"""Export a decode step to ONNX / ExecuTorch, verify it, describe it in manifest.json, and run it.

Stages (each a module, each returning a value you can inspect), in the order pipeline.export_model runs them
(pipeline._run: one small function per stage over the export in progress, pipeline.Export):
  trace.py      eager module -> torch.export ExportedPrograms (one per entry point)
  to_onnx.py    -> onnx.ModelProto: one graph `forward`, dynamic token axis `seq`
  to_pte.py     -> ExecuTorch EdgeProgramManager, XNNPACK: `forward` (1..C tokens; a plain kv cache written in
                   place) or `prefill` (fixed chunk) and `decode`
  targets.py    one object per format (ONNX, .pte): trace its entry points, lower + serialize, its verify steppers
  verify.py     artifact in its runtime vs the eager module, same calls, state fed back
  narrow_route.py  the weights' memory held low: a bf16 / fp16 checkpoint loaded narrow, verify-quant's fp32
                   reference computed once, the weights released when nothing after reads them (lazy_weights.py)
  manifest.py   manifest.json + manifest.schema.json; sha256 of every file, checked on load
  tokenizer.py  tokenizer.json from the GGUF vocabulary (or the HF folder's own)
  runtime.py    step an artifact with ONNX Runtime or the ExecuTorch runtime (no torch model code)
  generate.py   greedy generation for `edgekv run`
  cli.py        click commands `export` and `run` (heavy imports inside the commands only)
This __init__ imports nothing heavy: edgekv/cli.py imports edgekv.export.cli at start-up.
"""
