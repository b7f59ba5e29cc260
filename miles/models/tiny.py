"""`miles tiny-model`: write a small random-weight HF model directory with a working tokenizer.

Used by smoke tests and by the test suite instead of downloads. The tokenizer is a byte-level BPE
trained offline, at call time, on a fixed in-code corpus, so it round-trips any text exactly; digits
are split one per token (the arithmetic demo task needs single-token digits). Special tokens and
the chat template follow the ChatML convention (<|im_start|>role ... <|im_end|>), eos = <|im_end|>.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The BPE merges are learned from this text; any text still round-trips through the byte alphabet.
_CORPUS_WORDS = (
    "the a an is are was were be to of and or not in on at for with as by from that this it what which who "
    "how why when where answer question result number sum total plus minus times divided equals equal "
    "add subtract multiply divide compute calculate solve problem step think final therefore so then "
    "first second third next last yes no true false correct wrong good bad user assistant system you i "
    "we they he she please let us check value x y z n one two three four five six seven eight nine ten "
    "hello world model reward train test data token text word sentence math"
)
_CORPUS_LINES = (
    "What is 3+4? The answer is 7.",
    "Compute 12*5-6/2 = 57.",
    "Q: what is 9-2? A: 7",
    "Let us think step by step. The final answer is \\boxed{42}.",
    "(1+2)*3 = 9; 8/4 = 2; 5%3 = 2; 2^3 = 8",
)


def _corpus() -> list[str]:
    words = _CORPUS_WORDS.split()
    lines = list(_CORPUS_LINES)
    lines += [" ".join(words[i : i + 8]) for i in range(0, len(words), 8)]
    lines += [w.capitalize() + "." for w in words]
    return lines * 4


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (`PreTrainedTokenizerFast`) built offline; digits are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_config(
    arch: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    eos_id: int,
    pad_id: int,
):
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=4096,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        rope_theta=10000.0,
    )
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2Config(tie_word_embeddings=True, **common), Qwen2ForCausalLM
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig(
            tie_word_embeddings=False, rope_theta=500000.0, **{k: v for k, v in common.items() if k != "rope_theta"}
        ), LlamaForCausalLM
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3Config(tie_word_embeddings=True, head_dim=hidden // heads, **common), Qwen3ForCausalLM
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            head_dim=hidden // heads,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=max(intermediate // 2, 8),
            norm_topk_prob=True,
            **common,
        )
        return cfg, Qwen3MoeForCausalLM
    raise ValueError(f"arch={arch!r} is not supported; pick one of {SUPPORTED_ARCHS}")


def make_tiny_model(
    out_dir: str,
    arch: str = "qwen2",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    init_std: float | None = None,
    device: str | None = None,
) -> str:
    """Write a seeded random-weight HF causal LM (safetensors) plus tokenizer to `out_dir`; return `out_dir`.

    vocab: model vocabulary size; None = the tokenizer's size rounded up to a multiple of 64.
    init_std: weight init std (transformers' initializer_range, default 0.02); tests use a larger one so
    a random model's next-token distribution is peaked and its greedy text is not one repeated token.
    device: where the weights are drawn (default the CPU). A GPU draws a 7B-shape model in seconds where a
    host's CPU takes minutes; the values differ from the CPU's for the same seed (another generator).
    """
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads} and heads by kv_heads={kv_heads}")
    tokenizer = build_tokenizer()
    n_tok = len(tokenizer)
    vocab = vocab if vocab is not None else (n_tok + 63) // 64 * 64
    if vocab < n_tok:
        raise ValueError(f"vocab={vocab} is smaller than the tokenizer's {n_tok} tokens; pass vocab >= {n_tok}")
    config, model_cls = _build_config(
        arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        eos_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    if init_std is not None:
        config.initializer_range = init_std
    torch.manual_seed(seed)  # every device's generator
    with torch.device(device or "cpu"):
        model = model_cls(config)
    model = model.to(getattr(torch, dtype)).to("cpu")
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    logger.info("wrote tiny %s model (%d layers, hidden %d, vocab %d) to %s", arch, layers, hidden, vocab, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen2", choices=SUPPORTED_ARCHS)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--init-std", type=float, default=None, help="weight init std (default 0.02)")
    parser.add_argument("--device", default=None, help="draw the weights there (e.g. cuda: fast for large shapes)")
    args = parser.parse_args(argv)
    path = make_tiny_model(
        args.out_dir,
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        seed=args.seed,
        dtype=args.dtype,
        init_std=args.init_std,
        device=args.device,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
