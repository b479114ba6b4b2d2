"""Running the app under uvicorn: the drain on SIGTERM/SIGINT (run.py) and the deadline
on a request's head (head_deadline.py)."""

from gateway.server.run import DrainingServer, run_server

__all__ = ["DrainingServer", "run_server"]
