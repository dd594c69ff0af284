"""Every user-facing default of the model role, in one place (documented in README.md).

Where the weights come from and go (model.source / transfer / revision / path / hub_token) is in
the spec; the values here are fixed names and host data (``@deploy`` data_defaults).
"""

from vllm_fleet.roles.common.peers import DEFAULTS as PEERS

# Written into model.path: one `<sha256>  <relative path>` line per file (sha256sum's format),
# computed on the control machine; `sha256sum -c` on the host checks the upload against it.
MANIFEST = "MANIFEST.sha256"

# Written into model.path after a hub download: `<source>@<revision>`; a later deploy with the
# same source and revision downloads nothing.
HUB_MARKER = ".vllm-fleet-hub"

# Written under install.config_dir (root:root 0644) when the host's copy of an upload was verified
# (each file's sha256 against MANIFEST.sha256): the manifest's hash and every file under
# model.path with its size, mtime and ctime as the host's find saw them just before that check
# (host_state.sh's `tree` lines). A later deploy whose state read shows the same files with the
# same three values, and the same manifest, hashes nothing on the host.
STAMP = "model.stamp"

# The hub token's file on the host (under install.config_dir), root:root 0600; its path, never
# its value, is passed to the download command.
HUB_TOKEN_FILE = "hub-token"

DEFAULTS = {
    # Mode of uploaded model files and directories (the service user owns them; others may read).
    "model_file_mode": "644",
    "model_dir_mode": "755",
    # Bytes that must stay free on model.path's filesystem after an upload (plan-time check;
    # the deploy stops before any change when the files still to upload do not fit) or a hub
    # download (checked on the host against the repository's file sizes before it starts).
    "model_keep_free_bytes": 1 << 30,
    # Files of a hub repository that are not downloaded (fnmatch patterns on the repo's paths):
    # vLLM never loads them. Llama repositories carry original/consolidated.*.pth beside the
    # safetensors (about twice the download for Llama 3.1 70B).
    "model_hub_ignore": ["original/*", "*.pth"],
    # Hash every file of an upload on the host on this deploy (`vllm-fleet deploy --verify`, or
    # pyinfra's `--data model_verify=true`) instead of trusting the stamp (STAMP) of the last
    # verified copy; what differs is put again, and a new stamp is written.
    "model_verify": False,
    # Host to host (vllm_fleet.roles.common.peers): with host data private_address set, the
    # control machine sends an uploaded model (upload, hub_fetch: fleet) to one host and the
    # others fetch it from hosts holding a verified copy; false: every host from the control
    # machine. The peer servers listen on private_address:peer_port for the transfer only, and
    # stop themselves after peer_max_seconds if the deploy that started them did not stop them.
    "peer_fetch": True,
    "peer_port": PEERS["peer_port"],
    "peer_max_seconds": PEERS["peer_max_seconds"],
    # Extra environment for the hub download only (e.g. {"HF_ENDPOINT": "<a mirror>"}).
    "model_hub_env": {},
}
