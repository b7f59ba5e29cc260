"""HF export: sharded safetensors with model.safetensors.index.json, loadable by from_pretrained."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from miles.trainer.hf_io import SAFETENSORS_INDEX, plan_shards, write_hf_dir


def test_shards_fill_in_order_and_a_big_tensor_stands_alone() -> None:
    sizes = [("a", 3), ("b", 3), ("c", 5), ("d", 1), ("e", 10), ("f", 2)]
    # a+b = 6 fits; c would make 11; c+d = 6; e alone exceeds the limit; f starts a new shard after it.
    assert plan_shards(sizes, 6) == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    assert plan_shards(sizes, 1000) == [["a", "b", "c", "d", "e", "f"]]
    assert plan_shards([], 6) == []


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.models.tiny import make_tiny_model

    return Path(make_tiny_model(str(tmp_path_factory.mktemp("tiny")), layers=2, hidden=64, seed=3))


def _perturbed_params(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tiny model's parameters, changed so a load that silently fell back to the source would show."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {name: p.detach() + 0.5 for name, p in model.named_parameters()}


def test_export_is_sharded_indexed_and_loads_with_from_pretrained(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    params = _perturbed_params(tiny_model_dir)
    biggest = max(t.numel() * t.element_size() for t in params.values())
    out = tmp_path / "export"
    write_hf_dir(
        str(out),
        params.items(),
        config=AutoConfig.from_pretrained(tiny_model_dir),
        source_dir=str(tiny_model_dir),
        max_shard_bytes=biggest,
    )

    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(params)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in params.values())  # fp32
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == files  # no source weights copied
    assert all((out / f).stat().st_size <= biggest + 64 * 1024 for f in files)  # + the safetensors header

    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    loaded_params = dict(loaded.named_parameters())
    assert set(loaded_params) == set(params)
    for name, p in params.items():
        assert torch.equal(loaded_params[name].detach(), p), name
    assert AutoTokenizer.from_pretrained(str(out)).encode("hi") == AutoTokenizer.from_pretrained(
        str(tiny_model_dir)
    ).encode("hi")


def test_a_small_model_is_one_shard_with_its_index(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    params = _perturbed_params(tiny_model_dir)
    write_hf_dir(
        str(tmp_path / "one"), params.items(), config=AutoConfig.from_pretrained(tiny_model_dir), source_dir=None
    )
    index = json.loads((tmp_path / "one" / SAFETENSORS_INDEX).read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
