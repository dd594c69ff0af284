"""Host data the router role reads (pyinfra data_defaults)."""

DEFAULTS = {
    "router_pip_timeout": 120,  # s per pip network operation
    "router_start_timeout": 60,
    # Debian packages the router's venv needs (an image that has them outside dpkg lists fewer)
    "router_venv_packages": [
        "python3-venv"
    ],  # s: the router serves once its replicas answer (its startup wait is 30 s)
}
