"""`python -m gateway ...`: the `mlx-gateway` command (what `mlx.launch --python` runs)."""

from __future__ import annotations

import sys

from gateway.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
