"""train-tiny's arguments checked before torch loads: one line and exit 2 for what would otherwise be a traceback,
a run that never ends, or a folder made beside a file (issue 45, row 50: `--out /etc/passwd`)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


def problem_of(args: Any) -> str | None:
    """What is wrong with train-tiny's arguments (an argparse namespace), or None."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out must be a folder; {out.name!r} is a file"
    if out.parent.exists() and not os.access(out.parent, os.W_OK):
        return f"--out: cannot write in the folder above {out.name!r}"
    if not (math.isfinite(args.minutes) and args.minutes > 0):
        return f"--minutes must be a positive number, not {args.minutes}"
    if args.steps < 0:
        return f"--steps must be 0 (the time budget) or more, not {args.steps}"
    if not (math.isfinite(args.lr) and args.lr >= 0):
        return f"--lr must be 0 (the plan's) or a positive number, not {args.lr}"
    if args.threads is not None and args.threads < 0:
        return f"--threads must be 0 (all) or more, not {args.threads}"
    if args.init and not Path(args.init, "model_index.json").is_file():
        return "--init must be a saved pipeline's folder (one with model_index.json)"
    return None
