"""Which BLAS the CPU backend preloads (runtime/backend.py): the order of the candidates
by processor vendor, the environment's override, and what happens when one fails to
load. The loading itself is replaced: MLX is already imported in the test process."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import pytest

from runtime import backend

OPENBLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0", "system:openblas")
PIP_MKL = ("/venv/lib/libmkl_rt.so.2", "pip:mkl")
SYSTEM_MKL = ("libmkl_rt.so", "system:mkl")


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path the preload tries, in order; paths containing 'broken' fail to load."""
    tried: list[str] = []

    def cdll(path: str, mode: int = 0) -> Any:
        tried.append(path)
        assert mode == ctypes.RTLD_GLOBAL
        if "broken" in path:
            raise OSError(f"{path}: cannot open shared object file")
        return object()

    monkeypatch.setattr(backend, "_chosen", None)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.delenv(backend.ENV_BLAS, raising=False)
    monkeypatch.setattr(backend, "_system_openblas", lambda: [OPENBLAS])
    monkeypatch.setattr(backend, "_pip_candidates", lambda: [PIP_MKL])
    monkeypatch.setattr(backend, "_system_mkl", lambda: [SYSTEM_MKL])
    return tried


@pytest.mark.parametrize(
    ("vendor", "first"),
    [("AuthenticAMD", OPENBLAS), ("GenuineIntel", PIP_MKL), ("", PIP_MKL)],
)
def test_openblas_goes_first_on_amd_and_mkl_elsewhere(
    loads: list[str], monkeypatch: pytest.MonkeyPatch, vendor: str, first: tuple[str, str]
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: vendor)
    chosen = backend.configure_blas()
    assert (chosen.path, chosen.source) == first
    assert loads == [first[0]]
    assert backend.configure_blas() is chosen  # idempotent: nothing loaded twice
    assert loads == [first[0]]


def test_a_library_that_fails_to_load_gives_way_to_the_next(
    loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(backend, "_system_openblas", lambda: [("/broken/libopenblas.so", "x")])
    chosen = backend.configure_blas()
    assert chosen.source == "pip:mkl"
    assert loads == ["/broken/libopenblas.so", PIP_MKL[0]]


def test_the_environment_names_the_library_or_turns_the_preload_off(
    loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setenv(backend.ENV_BLAS, "/opt/blis/libblis.so")
    assert backend.configure_blas() == backend.BlasChoice("/opt/blis/libblis.so", "env")
    monkeypatch.setattr(backend, "_chosen", None)
    monkeypatch.setenv(backend.ENV_BLAS, "none")
    assert backend.configure_blas() == backend.BlasChoice(None, "none")
    assert loads == ["/opt/blis/libblis.so"]


def test_nothing_found_is_said_and_runs_on_the_reference_blas(
    loads: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("_system_openblas", "_pip_candidates", "_system_mkl"):
        monkeypatch.setattr(backend, name, lambda: [])
    with caplog.at_level("WARNING", logger=backend.__name__):
        assert backend.configure_blas() == backend.BlasChoice(None, "none")
    assert "libopenblas0-pthread" in caplog.text
    assert loads == []


def test_the_vendor_is_read_from_cpuinfo() -> None:
    vendor = backend.cpu_vendor()
    assert isinstance(vendor, str)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        assert vendor == ""
        return
    assert (f": {vendor}\n" in text) if vendor else ("vendor_id" not in text)
