"""Running the app under uvicorn: the drain on SIGTERM/SIGINT (run.py), the deadline
on a request's head (head_deadline.py) and the bound on open connections
(connections.py)."""

from gateway.server.connections import server_protocol
from gateway.server.run import DrainingServer, StartupFailed, run_server

__all__ = ["DrainingServer", "StartupFailed", "run_server", "server_protocol"]
