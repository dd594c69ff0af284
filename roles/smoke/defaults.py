"""Defaults of the smoke role (documented in README.md beside this file)."""

DEFAULTS = {
    # Seconds one smoke request may take (a cold CPU model answers in well under this).
    "smoke_timeout": 120,
    # Tokens of the streamed check (ignore_eos; capped at half of model.max_model_len): long
    # enough that the CPU lab's bursts of output cannot look like a buffering proxy.
    "smoke_stream_tokens": 256,
    # Where the client settings file (OpenAI-compatible base_url, model, where the key is) is
    # written on the control machine; {name} is the deployment name.
    "smoke_client_settings": "~/.config/vllm-fleet/{name}/openai.json",
}
