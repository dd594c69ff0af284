"""Runs on a host with the env's python: write files into its site-packages (purelib).

python write_site_files.py '{"relative/path": "text", ...}'
"""

import json, pathlib, sys, sysconfig

site = pathlib.Path(sysconfig.get_paths()["purelib"])
for rel, text in json.loads(sys.argv[1]).items():
    p = site / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
