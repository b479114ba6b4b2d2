"""The `mlx-gateway` command (entry point gateway.cli.main:main): main.py dispatches,
args.py builds the options, common.py holds what commands share; serve/, store/,
chat.py and launch/ are the commands.

Nothing is imported here: launch starts `python -m gateway.cli.main`, which must not
find its own module already imported by its package."""

__all__: list[str] = []
