"""Model specs resolve to directories before a run starts; the controller refuses a spec it was handed."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config import ModelConfig
from miles.controller.preflight import PreflightError, check_model_path
from miles.models.resolve import parse_tiny_spec, resolve_model_paths
from miles.utils.hf_cache import ModelNotFound


def test_tiny_specs_name_arch_and_size() -> None:
    assert parse_tiny_spec("tiny:") == ("qwen2", 2, 64)
    assert parse_tiny_spec("tiny:llama") == ("llama", 2, 64)
    assert parse_tiny_spec("tiny:qwen3:4X128") == ("qwen3", 4, 128)
    with pytest.raises(ModelNotFound, match=r"'tiny:qwen2:2by64': write the size as LAYERSxHIDDEN"):
        parse_tiny_spec("tiny:qwen2:2by64")


def test_a_tiny_spec_becomes_its_cached_directory_for_every_model_field(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MILES_CACHE", str(tmp_path))
    cached = tmp_path / "tiny-llama-3x32-seed7"
    cached.mkdir()
    (cached / "config.json").write_text("{}")  # already built: nothing is built again
    model = ModelConfig(hf_checkpoint="tiny:llama:3x32", ref_load="tiny:llama:3x32", critic_load=None)
    assert resolve_model_paths(model, seed=7) is True
    assert (model.hf_checkpoint, model.ref_load, model.critic_load) == (str(cached), str(cached), None)


def test_the_controller_refuses_an_unresolved_spec(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"--hf-checkpoint 'tiny:qwen2' is not a model directory; resolve it"):
        check_model_path(ModelConfig(hf_checkpoint="tiny:qwen2"))
    with pytest.raises(PreflightError, match="is an empty directory"):
        check_model_path(ModelConfig(hf_checkpoint=str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    check_model_path(ModelConfig(hf_checkpoint=str(tmp_path)))  # a model directory passes
