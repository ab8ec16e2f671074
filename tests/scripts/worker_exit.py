"""How every torchrun worker under tests/scripts ends: each rank prints its problems and
``RANK <r> OK`` when it has none, tears the process group down and exits non-zero on failure."""

import os
import sys
import traceback
from typing import Callable

import torch.distributed as dist


def run_worker(main: Callable[[], int], problems: list[str], label: str) -> None:
    """Run ``main`` and report for the test, which reads every rank's lines from stdout."""
    code = 0
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        code = 2
    rank = os.environ.get("RANK", "?")
    for p in problems:
        print(f"RANK {rank} {label}: {p}", flush=True)
    if code == 0 and not problems:
        print(f"RANK {rank} OK", flush=True)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.exit(code or (1 if problems else 0))
