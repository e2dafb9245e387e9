"""Run an export in a fresh process and measure peak memory and speed against the plan (`edgekv profile`)."""
