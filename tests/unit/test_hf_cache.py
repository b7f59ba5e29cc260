"""`--hf-checkpoint ORG/NAME`: resolved from a fake Hugging Face cache, offline; one clear line when absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import ModelConfig
from miles.models.resolve import resolve_model_paths
from miles.utils.hf_cache import ModelNotFound

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache that HF_HUB_CACHE points at (the constant too: huggingface_hub reads it at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache_model(cache: Path, repo_id: str, *, ref: str = "main", files: dict[str, str] | None = None) -> Path:
    """The layout the Hub client writes: models--org--name/snapshots/<commit>/... and refs/<ref>."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, text in (files if files is not None else {"config.json": json.dumps({"model_type": "qwen2"})}).items():
        (snapshot / name).write_text(text)
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(COMMIT)
    return snapshot


def _model(hf_checkpoint: str, ref_load: str | None = None) -> ModelConfig:
    return ModelConfig(hf_checkpoint=hf_checkpoint, ref_load=ref_load, critic_load=None)


def test_a_cached_hub_id_becomes_its_snapshot_directory(hub_cache: Path) -> None:
    snapshot = _cache_model(hub_cache, "HuggingFaceTB/SmolLM2-135M-Instruct")
    model = _model("HuggingFaceTB/SmolLM2-135M-Instruct", ref_load="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolve_model_paths(model, seed=1) is True
    assert Path(model.hf_checkpoint) == snapshot
    assert Path(model.ref_load) == snapshot  # the reference model defaults to the same id
    assert model.critic_load is None


def test_a_revision_after_at_reads_that_ref(hub_cache: Path) -> None:
    snapshot = _cache_model(hub_cache, "org/model", ref="v1.0")
    model = _model("org/model@v1.0")
    assert resolve_model_paths(model, seed=1) is True
    assert Path(model.hf_checkpoint) == snapshot


def test_an_uncached_id_is_one_line_naming_it_and_the_download(hub_cache: Path) -> None:
    _cache_model(hub_cache, "org/other")
    with pytest.raises(ModelNotFound) as info:
        resolve_model_paths(_model("org/missing-model"), seed=1)
    message = str(info.value)
    assert "'org/missing-model' is not a local directory" in message
    assert "hf download org/missing-model" in message and str(hub_cache) in message
    assert "\n" not in message


def test_a_snapshot_without_config_is_refused(hub_cache: Path) -> None:
    _cache_model(hub_cache, "org/partial", files={"tokenizer.json": "{}"})
    with pytest.raises(ModelNotFound, match="has no config.json .* run `hf download org/partial` again"):
        resolve_model_paths(_model("org/partial"), seed=1)


def test_a_local_directory_wins_and_is_left_as_given(hub_cache: Path, tmp_path: Path) -> None:
    local = tmp_path / "org" / "model"
    local.mkdir(parents=True)
    _cache_model(hub_cache, "org/model")
    model = _model(str(local))
    assert resolve_model_paths(model, seed=1) is False
    assert model.hf_checkpoint == str(local)


def test_a_missing_absolute_path_says_so(hub_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist; pass a model directory or a Hub id"):
        resolve_model_paths(_model(str(tmp_path / "no-such-model")), seed=1)
