"""Gated DeltaNet (Qwen3.5 / Qwen3-Next): the delta rule with a per-head scalar decay."""
