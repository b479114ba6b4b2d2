"""`mlx-gateway pull` and `mlx-gateway list`: the store's two commands (neither loads MLX)."""

from __future__ import annotations

import argparse

from gateway.cli.store.store import Store


def pull(args: argparse.Namespace) -> int:
    print(Store().pull_name(args.model))
    return 0


def list_models(_: argparse.Namespace) -> int:
    for item in Store().list():
        mark = "*" if item.present else " "
        size = f"{item.size / 1e6:8.1f} MB" if item.size else " " * 11
        print(f"{mark} {item.alias:<22} {size}  {item.path}")
    print("(* = downloaded)")
    return 0
