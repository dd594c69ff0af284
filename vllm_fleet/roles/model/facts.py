"""Facts for the model role: free space where the weights go (what is already there comes from
the state read, vllm_fleet.roles.common.state)."""

from __future__ import annotations

from pyinfra.api import FactBase, StringCommand

from vllm_fleet.host.programs import argv


class FreeBytes(FactBase):
    """Bytes available to unprivileged writers on the filesystem that holds ``path``, or its
    nearest existing parent when ``path`` does not exist yet (``df -PB1``'s "Available").

    ``host.get_fact(FreeBytes, path="/var/lib/vllm-fleet/x/model")`` -> ``123456789`` (None when
    df printed nothing usable).
    """

    def command(self, path: str) -> StringCommand:
        return argv("sh", "-c", 'p=$1; while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done; '
                    'df -PB1 "$p" | tail -n 1', "free-bytes", path)

    @staticmethod
    def default():
        return None

    def process(self, output: list[str]):
        fields = (output[-1] if output else "").split()
        try:
            return int(fields[3])
        except (IndexError, ValueError):
            return None

