"""Facts for the model role: free space where the weights go, and the sizes already there."""

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


class FileSizes(FactBase):
    """``{relative path: size in bytes}`` of every regular file under ``root`` (``{}`` when
    ``root`` does not exist).

    ``host.get_fact(FileSizes, root="/var/lib/vllm-fleet/x/model")`` -> ``{"config.json": 655}``
    """

    def command(self, root: str) -> StringCommand:
        return StringCommand(argv("test", "-d", root), "&&", argv("find", root, "-type", "f", "-printf", "%s %P\\n"),
                             "||", "true")

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output: list[str]) -> dict[str, int]:
        out = {}
        for line in output:
            size, _, rel = line.partition(" ")
            if rel and size.isdigit():
                out[rel] = int(size)
        return out
