"""Defaults of the smoke role (documented in README.md beside this file)."""

DEFAULTS = {
    # Seconds one smoke request may take (a cold CPU model answers in well under this).
    "smoke_timeout": 120,
    # Tokens of the streamed check (ignore_eos; capped at half of model.max_model_len). Keep the
    # stream smaller than nginx's proxy buffers (~200 bytes a token): a buffering proxy then
    # holds all of it, which is what the check detects.
    "smoke_stream_tokens": 64,
    # Where the client settings file (OpenAI-compatible base_url, model, where the key is) is
    # written on the control machine; {name} is the deployment name.
    "smoke_client_settings": "~/.config/vllm-fleet/{name}/openai.json",
}
