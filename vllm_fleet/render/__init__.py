"""Rendering: the per-host layout, the one vLLM command line, every file a host gets (templates, monitoring, secrets by
name)."""
