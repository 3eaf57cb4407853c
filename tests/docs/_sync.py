"""docs/sync.py, imported by path (docs/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_sync", ROOT / "docs" / "sync.py")
sync = importlib.util.module_from_spec(_spec)
sys.modules["docs_sync"] = sync  # dataclasses look their module up
_spec.loader.exec_module(sync)
