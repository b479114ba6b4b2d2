"""Running the app under uvicorn: the drain on SIGTERM/SIGINT (run.py) and the deadline
on a request's head (head_deadline.py)."""

from gateway.server.run import DrainingServer, StartupFailed, run_server

__all__ = ["DrainingServer", "StartupFailed", "run_server"]
