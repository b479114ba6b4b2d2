"""The soak: mixed load against a real `mlx-gateway serve` for minutes to hours
(`python tests/soak/soak.py --help`); tests/test_soak_short.py runs it for a minute."""
