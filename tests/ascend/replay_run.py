"""Run one of this folder's replay scripts (``replay.py``, ``gdn_replay.py``, ``sched_replay.py``)
in a subprocess and read its JSON result; shared by the Ascend replay test modules.

The scripts write ``{"error": None | str, ...}`` to ``--out``; a script that cannot run (an
import of vllm-ascend failing, say) reports it there instead of crashing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

try:  # the session seed of the root conftest (printed by pytest), else the variable or a fresh one
    from conftest import SESSION_SEED as SEED
except ImportError:
    SEED = int(os.environ.get("VLLM_HYBRID_NPU_TEST_SEED") or random.SystemRandom().randrange(2**31))


def run_replay(cmd: list[str], out: Path, timeout: float) -> dict:
    """Run ``cmd`` (which writes its result to ``out``), return the parsed result.

    Raises:
        AssertionError: the subprocess failed or wrote nothing (its command, stdout and stderr
            tails and :data:`SEED` in the message), or the script reported an ``error``.
    """
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and out.exists(), (
        f"replay subprocess failed (seed {SEED}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-6000:]}")
    res = json.loads(out.read_text())
    out.unlink()
    assert res["error"] is None, f"replay could not run (seed {SEED}):\n{res['error']}"
    return res
