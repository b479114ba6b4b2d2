"""mlx-gateway's HTTP and CLI side: the app (gateway.app.create_app), one folder per API
dialect, the shared core, the server runner and the `mlx-gateway` command.

Nothing is imported here: every `import gateway.<module>` runs this file first, and the
CLI's start-up must not load the app, its routes or MLX (gateway/cli/main.py)."""

__all__: list[str] = []
