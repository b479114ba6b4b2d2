"""The soak: mixed load against a real `mlx-gateway serve` for minutes to hours
(`python tests/support/soak/soak.py --help`); tests/gateway/test_soak_short.py runs it for a minute."""
