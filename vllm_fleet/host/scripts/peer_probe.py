"""Wait (up to 10 s) until a peer server answers a HEAD of URL with 200 (scripts/serve_files.py
in its transient unit, just started). Exit 0 when it does, 1 with the last error when not.

    python3 peer_probe.py URL
"""

import sys
import time
import urllib.request


def main(url):
    last, deadline = "", time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=3) as r:
                if r.status == 200:
                    return 0
                last = f"HTTP {r.status}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    print(f"peer probe: no answer: {last}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
