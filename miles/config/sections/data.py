"""The `data` section: the prompt data: file, keys, chat template, shuffling, length limits."""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.option import SEED_RANGE, option


@dataclass
class DataConfig:
    """The prompt data: file, keys, chat template, shuffling, length limits."""

    prompt_data: str | None = option(None, "JSONL or parquet file of prompts (parquet needs the parquet extra)")
    input_key: str = option("input", "JSONL key of the prompt (text or chat messages)")
    label_key: str | None = option(None, "JSONL key of the label / ground truth")
    metadata_key: str = option("metadata", "JSONL key of per-row metadata (dict)")
    tool_key: str = option("tools", "JSONL key of tool specs, copied into metadata['tools']")
    apply_chat_template: bool = option(False, "render chat prompts with the tokenizer's chat template")
    rollout_shuffle: bool = option(False, "shuffle prompts every epoch")
    rollout_seed: int = option(42, "seed for shuffling and sampling", range=SEED_RANGE, unit="a seed")
    rollout_max_prompt_len: int | None = option(
        None,
        "drop prompts longer than this many tokens (default: what the engines fit)",
        range="[1, inf)",
        unit="tokens",
    )
    refuse_long_prompts: bool = option(
        False, "stop at start-up on a prompt over the limit instead of skipping and counting it"
    )
    skip_bad_rows: bool = option(
        False, "skip and count malformed JSONL rows (bad JSON, not UTF-8) instead of stopping"
    )
    data_source_path: str | None = option(None, "import path of a custom data source class")
    num_epoch: int | None = option(
        None,
        "epochs over the prompt data (derives --num-rollout)",
        range="[1, inf)",
        unit="passes over the prompt data",
    )
