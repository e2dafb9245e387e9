"""edgekv: plan, analyze, export and verify long-context LLM deployments on phones."""
__version__ = "0.1.0"
