"""`mlx-gateway` with the prefix cache's disk writer stopped in the middle of a file, so
that tests/gateway/test_faults.py can kill the process -9 while a write is under way, every time.

    python -m tests.support.fault_serve FRACTION serve --model ... --prefix-cache-dir ...

The first prefix-cache file written puts FRACTION of its bytes under its temporary name
(fsynced, so they are on disk whatever happens next), prints one line naming it to
stderr, and then blocks forever; later jobs queue behind it. Nothing in the product
changes: the launcher replaces `runtime.prefix.disk.files.save_file`, the one function
`write_entry` calls to put the bytes down, before the CLI starts.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping

from runtime import backend

STALLED = "fault_serve: stalled writing"


def _stalling_save(fraction: float) -> Callable[..., None]:
    from safetensors.numpy import save

    def save_file(tensors: Mapping[str, object], filename: str, metadata: object = None) -> None:
        data = save(tensors, metadata=metadata)  # type: ignore[arg-type]
        with open(filename, "wb") as out:
            out.write(data[: int(len(data) * fraction)])
            out.flush()
            os.fsync(out.fileno())
        print(f"{STALLED} {filename} ({len(data)} bytes)", file=sys.stderr, flush=True)
        threading.Event().wait()  # until the test's SIGKILL

    return save_file


def main(argv: list[str]) -> int:
    fraction, *rest = argv
    backend.configure()  # before anything imports mlx
    import runtime.prefix.disk.files as prefix_files
    from gateway.cli.main import main as cli

    setattr(prefix_files, "save_file", _stalling_save(float(fraction)))  # noqa: B010
    return cli(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
