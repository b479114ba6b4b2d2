"""`mlx-gateway serve`: the command (command.py), the models it is given (models.py) and
one model over several processes (distributed.py, distributed_stop.py)."""

from gateway.cli.serve.command import serve

__all__ = ["serve"]
