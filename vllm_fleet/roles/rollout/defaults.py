"""Defaults of the rollout role (documented in README.md beside this file).

The batch size, drain and health deadlines come from the spec's `rollout` section (and the
command line of `vllm-fleet rollout`); these are the role's own knobs.
"""

DEFAULTS = {
    # Seconds between polls while draining (old nginx workers, vLLM's running/waiting requests).
    "rollout_poll_interval": 0.5,
    # Tokens the replica's own smoke chat asks for (plain and streamed).
    "rollout_smoke_max_tokens": 16,
    # Seconds per request of the replica's own smoke test.
    "rollout_smoke_timeout": 120,
    # Journal lines shown when the replica's smoke test fails.
    "rollout_journal_lines": 40,
}
