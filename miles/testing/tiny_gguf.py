"""A tiny qwen2 GGUF file (random float32 weights, a byte-level BPE tokenizer, a ChatML template) for tests.

Written with the `gguf` package's `GGUFWriter`, in llama.cpp's tensor names, so transformers' own GGUF
loader reads it as it reads a real Qwen2.5 file. `write_tiny_qwen2_gguf` returns the arrays it wrote, so
a test can check a conversion against the bytes on disk and not only against another loader.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 base tokens of a byte-level BPE vocabulary."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def _tensors(rng: np.random.Generator, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int):
    head_dim = hidden // heads

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    out = {
        "token_embd.weight": w(vocab, hidden),
        "output_norm.weight": 1 + w(hidden),
        "output.weight": w(vocab, hidden),
    }
    for i in range(layers):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": 1 + w(hidden),
            b + "attn_q.weight": w(heads * head_dim, hidden), b + "attn_q.bias": w(heads * head_dim),
            b + "attn_k.weight": w(kv_heads * head_dim, hidden), b + "attn_k.bias": w(kv_heads * head_dim),
            b + "attn_v.weight": w(kv_heads * head_dim, hidden), b + "attn_v.bias": w(kv_heads * head_dim),
            b + "attn_output.weight": w(hidden, heads * head_dim),
            b + "ffn_norm.weight": 1 + w(hidden),
            b + "ffn_gate.weight": w(ffn, hidden), b + "ffn_up.weight": w(ffn, hidden), b + "ffn_down.weight": w(hidden, ffn),
        })  # fmt: skip
    return out


def write_tiny_qwen2_gguf(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 64,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write the file; returns {gguf tensor name: array written} (arrays in PyTorch's [out, in] layout)."""
    from gguf import GGUFWriter  # the test dependency; never needed at run time

    tokens = _byte_tokens() + ["Ġt", "he", "Ġthe"] + list(SPECIALS)
    merges = ["Ġ t", "h e", "Ġt he"]
    vocab = len(tokens)
    tensors = _tensors(np.random.default_rng(seed), vocab, hidden, layers, heads, kv_heads, ffn)
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(0)  # all float32
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - len(SPECIALS)) + [3] * len(SPECIALS))  # 1 normal, 3 control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors
