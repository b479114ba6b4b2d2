"""Which BLAS the CPU backend preloads (runtime/backend.py): the order of the candidates
by processor vendor, the environment's override, and what happens when one fails to
load. The loading itself is replaced: MLX is already imported in the test process (the
real preload of pip's OpenBLAS is tests/runtime/test_blas_shim.py)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime import backend

PIP_OPENBLAS = ("/venv/site-packages/scipy_openblas32/lib/libscipy_openblas.so", "pip:openblas")
SHIM = "/repo/runtime/_blas_shim.so"
OPENBLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0", "system:openblas")
PIP_MKL = ("/venv/lib/libmkl_rt.so.2", "pip:mkl")
SYSTEM_MKL = ("libmkl_rt.so", "system:mkl")
OPENBLAS_VARIABLES = tuple(backend.OPENBLAS_ENV)


class _Library:
    """What ctypes.CDLL returns here: the shim's probe answers `forwards`."""

    def __init__(self, forwards: int) -> None:
        self.forwards = forwards

    def mlxgw_blas_shim_forwards(self) -> int:
        return self.forwards


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path the preload tries, in order; paths containing 'broken' fail to load, and
    a shim path containing 'empty' forwards nothing."""
    tried: list[str] = []

    def cdll(path: str, mode: int = 0) -> Any:
        tried.append(path)
        assert mode == ctypes.RTLD_GLOBAL
        if "broken" in path:
            raise OSError(f"{path}: cannot open shared object file")
        return _Library(0 if "empty" in path else 1)

    monkeypatch.setattr(backend, "_chosen", None)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.delenv(backend.ENV_BLAS, raising=False)
    for key in OPENBLAS_VARIABLES:  # set by the preload: restored after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(backend, "shim_path", lambda: SHIM)
    monkeypatch.setattr(backend, "pip_openblas", lambda: [PIP_OPENBLAS])
    monkeypatch.setattr(backend, "_system_openblas", lambda: [OPENBLAS])
    monkeypatch.setattr(backend, "_pip_candidates", lambda: [PIP_MKL])
    monkeypatch.setattr(backend, "_system_mkl", lambda: [SYSTEM_MKL])
    return tried


@pytest.mark.parametrize(
    ("vendor", "first"),
    [
        ("AuthenticAMD", OPENBLAS),
        ("", OPENBLAS),  # aarch64, or /proc/cpuinfo unread
        ("GenuineIntel", PIP_MKL),
    ],
)
def test_openblas_goes_first_and_mkl_on_intel(
    loads: list[str], monkeypatch: pytest.MonkeyPatch, vendor: str, first: tuple[str, str]
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: vendor)
    chosen = backend.configure_blas()
    assert (chosen.path, chosen.source) == first
    assert loads == [first[0]]
    assert backend.configure_blas() is chosen  # idempotent: nothing loaded twice
    assert loads == [first[0]]


def test_pips_openblas_serves_where_the_systems_is_missing(
    loads: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(backend, "_system_openblas", lambda: [])
    assert backend.configure_blas() == backend.BlasChoice(*PIP_OPENBLAS)
    assert loads == [PIP_OPENBLAS[0], SHIM]  # the OpenBLAS, then the shim that binds to it
    monkeypatch.setattr(backend, "_chosen", None)
    monkeypatch.setattr(backend, "pip_openblas", lambda: [])
    with caplog.at_level("INFO", logger=backend.__name__):
        assert backend.configure_blas() == backend.BlasChoice(*PIP_MKL)
    assert "scipy-openblas32" in caplog.text  # MKL on AMD: says what to install instead


def test_a_shim_that_forwards_nothing_gives_way(
    loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(backend, "_system_openblas", lambda: [])
    monkeypatch.setattr(backend, "shim_path", lambda: "/repo/runtime/_blas_shim_empty.so")
    assert backend.configure_blas() == backend.BlasChoice(*PIP_MKL)
    assert loads == [PIP_OPENBLAS[0], "/repo/runtime/_blas_shim_empty.so", PIP_MKL[0]]


def test_a_library_that_fails_to_load_gives_way_to_the_next(
    loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(backend, "pip_openblas", lambda: [("/broken/libscipy_openblas.so", "x")])
    monkeypatch.setattr(backend, "_system_openblas", lambda: [("/broken/libopenblas.so", "x")])
    chosen = backend.configure_blas()
    assert chosen.source == "pip:mkl"
    assert loads == ["/broken/libopenblas.so", "/broken/libscipy_openblas.so", PIP_MKL[0]]


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


@pytest.mark.parametrize("named", [PIP_OPENBLAS, PIP_MKL, SYSTEM_MKL])
def test_the_environment_names_a_source(
    loads: list[str], monkeypatch: pytest.MonkeyPatch, named: tuple[str, str]
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setenv(backend.ENV_BLAS, named[1])
    assert backend.configure_blas() == backend.BlasChoice(*named)
    assert loads == [named[0], SHIM] if named == PIP_OPENBLAS else [named[0]]


def test_a_source_not_found_falls_back_to_the_probe(
    loads: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(backend, "_system_mkl", lambda: [])
    monkeypatch.setenv(backend.ENV_BLAS, "system:mkl")
    with caplog.at_level("WARNING", logger=backend.__name__):
        assert backend.configure_blas() == backend.BlasChoice(*OPENBLAS)
    assert "system:mkl" in caplog.text


def test_nothing_found_is_said_and_runs_on_the_reference_blas(
    loads: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("pip_openblas", "_system_openblas", "_pip_candidates", "_system_mkl"):
        monkeypatch.setattr(backend, name, lambda: [])
    with caplog.at_level("WARNING", logger=backend.__name__):
        assert backend.configure_blas() == backend.BlasChoice(None, "none")
    assert "mlx-gateway[cpu]" in caplog.text
    assert loads == []


def test_pips_openblas_is_a_candidate_only_with_the_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on disk: the `cpu` extra's scipy-openblas32, and only while the shim exists."""
    monkeypatch.setattr(backend, "shim_path", lambda: None)
    assert backend.pip_openblas() == []
    monkeypatch.setattr(backend, "shim_path", lambda: SHIM)
    found = backend.pip_openblas()
    if importlib.util.find_spec("scipy_openblas32") is None:
        assert found == []
        return
    assert [source for _, source in found] == [backend.PIP_OPENBLAS]
    assert Path(found[0][0]).is_file()


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


def test_an_openblas_loads_with_its_settings_and_the_users_win(
    loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "AuthenticAMD")
    backend.configure_blas()
    assert os.environ["OPENBLAS_THREAD_TIMEOUT"] == "4"
    monkeypatch.setattr(backend, "_chosen", None)
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "20")
    backend.configure_blas()
    assert os.environ["OPENBLAS_THREAD_TIMEOUT"] == "20"


def test_mkl_loads_without_openblas_settings(
    loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend, "cpu_vendor", lambda: "GenuineIntel")
    assert backend.configure_blas() == backend.BlasChoice(*PIP_MKL)
    assert not any(key in os.environ for key in OPENBLAS_VARIABLES)
