# api_key.py (included by host scripts: `# vllm-fleet: include api_key.py`): the one reader of the
# API key on a host, from the deployment's secrets.env (a systemd EnvironmentFile written by
# vllm_fleet.render.files.env_file: KEY=value, the value bare, 'single-quoted' or "double-quoted"
# with \\ \" \` \$ escaped). None when the file has no VLLM_API_KEY line.
def api_key(secrets_env):
    import re as _re

    for line in open(secrets_env):
        if line.startswith("VLLM_API_KEY="):
            v = line.split("=", 1)[1].strip()
            if len(v) >= 2 and v[0] == v[-1] == "'":
                return v[1:-1]
            if len(v) >= 2 and v[0] == v[-1] == '"':
                return _re.sub(r'\\([\\"`$])', r"\1", v[1:-1])
            return v
    return None
