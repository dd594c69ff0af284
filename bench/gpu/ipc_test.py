"""CUDA IPC of cuMem memory between two processes, as TP ranks on one host do it (issue 39).

    python ipc_test.py RESULT.json

One process allocates a CUDA tensor with PyTorch's expandable segments (cuMem memory), a second
(spawned) process rebuilds it from ``reduce_tensor``'s handle: for cuMem memory the importer takes
the exporter's file descriptor with pidfd_open + pidfd_getfd. Writes {"ok", "error", ...} to
RESULT.json and stdout; exit 0 when the child read the tensor's values back.
"""

import json
import os
import sys

os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.multiprocessing.reductions import reduce_tensor  # noqa: E402

N = 1 << 20


def child(handles, answers) -> None:
    try:
        rebuild, args = handles.get(timeout=120)
        t = rebuild(*args)
        answers.put({"ok": bool(float(t.sum().item()) == 3.0 * N), "sum": float(t.sum().item())})
    except Exception as e:  # the EPERM of a blocked pidfd_getfd arrives here as a RuntimeError
        answers.put({"ok": False, "error": repr(e)})


def main() -> int:
    ctx = mp.get_context("spawn")
    handles, answers = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(handles, answers))
    p.start()
    x = torch.full((N,), 3.0, device="cuda")
    handles.put(reduce_tensor(x))
    res = answers.get(timeout=180)
    p.join(60)
    res.update(
        torch=torch.__version__,
        uid=os.getuid(),
        alloc_conf=os.environ["PYTORCH_CUDA_ALLOC_CONF"],
        device=torch.cuda.get_device_name(0),
    )
    text = json.dumps(res)
    print(text, flush=True)
    with open(sys.argv[1], "w") as f:
        f.write(text + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
