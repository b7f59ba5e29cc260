"""LoRA on the embedded engine: the adapter merged into the resident base, checked against peft.

References are independent of the engine: merged weights are computed here from the checkpoint's
safetensors, and log-probs come from `transformers` with the adapter injected by peft (the path
the trainer takes), so naming, scaling and the merge are all checked at once.
"""

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from miles.engines.embedded.engine import EmbeddedEngine
from miles.models.tiny import make_tiny_model
from miles.weights.receiver import WeightReceiver

peft = pytest.importorskip("peft")
torch.set_num_threads(1)
CONFIG = {"r": 2, "lora_alpha": 6}  # scaling 3


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "qwen2": make_tiny_model(str(root / "qwen2"), arch="qwen2", init_std=0.2, seed=0),
        "llama": make_tiny_model(str(root / "llama"), arch="llama", init_std=0.2, seed=0),
    }


def _base(model_dir: str) -> dict[str, torch.Tensor]:
    import glob

    out = {}
    for f in glob.glob(f"{model_dir}/*.safetensors"):
        out.update(load_file(f))
    return out


def _adapter(base: dict[str, torch.Tensor], modules: list[str], seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    named = []
    for m in modules:
        out_dim, in_dim = base[f"{m}.weight"].shape
        named.append((f"{m}.lora_A.weight", torch.randn(CONFIG["r"], in_dim, generator=g)))
        named.append((f"{m}.lora_B.weight", torch.randn(out_dim, CONFIG["r"], generator=g)))
    return named


def _merged(base, named, module):
    a, b = dict(named)[f"{module}.lora_A.weight"], dict(named)[f"{module}.lora_B.weight"]
    return base[f"{module}.weight"] + 3.0 * (b @ a)


Q, GATE, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.down_proj"


def test_merge_from_the_base_never_accumulates_and_unload_restores(model_dirs):
    path = model_dirs["qwen2"]
    base = _base(path)
    engine = EmbeddedEngine(path)
    params = engine.model.params
    first = _adapter(base, [Q, GATE, DOWN], seed=1)  # q and gate live inside fused storage
    engine.load_lora_adapter(first, CONFIG, "a")
    for m in (Q, GATE, DOWN):
        torch.testing.assert_close(params[f"{m}.weight"], _merged(base, first, m), rtol=0, atol=1e-5)
    assert torch.equal(
        params["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"]
    )
    second = _adapter(base, [DOWN], seed=2)
    engine.load_lora_adapter(second, CONFIG, "a")
    assert torch.equal(params[f"{Q}.weight"], base[f"{Q}.weight"])  # no longer adapted: its base, exactly
    torch.testing.assert_close(params[f"{DOWN}.weight"], _merged(base, second, DOWN), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="unload it first"):
        engine.load_weights([(f"{Q}.weight", base[f"{Q}.weight"])])
    engine.unload_lora_adapter("a")
    for name, t in base.items():
        if name in params:
            assert torch.equal(params[name], t), name


@pytest.mark.parametrize(
    ("named", "match"),
    [
        ([("lm_head.lora_A.weight", torch.zeros(2, 64)), ("lm_head.lora_B.weight", torch.zeros(576, 2))], "tied"),
        ([(f"{Q}.lora_A.weight", torch.zeros(2, 64))], "lacks lora_A or lora_B"),
        ([(f"{Q}.lora_A.weight", torch.zeros(3, 64)), (f"{Q}.lora_B.weight", torch.zeros(64, 3))], "expected"),
        (
            [
                ("model.layers.9.mlp.up_proj.lora_A.weight", torch.zeros(2, 64)),
                ("model.layers.9.mlp.up_proj.lora_B.weight", torch.zeros(128, 2)),
            ],
            "no weight",
        ),
        ([(f"{Q}.weight", torch.zeros(64, 64))], "not a LoRA tensor"),
    ],
)
def test_bad_adapters_are_refused_and_change_nothing(model_dirs, named, match):
    engine = EmbeddedEngine(model_dirs["qwen2"])
    before = {n: t.clone() for n, t in engine.model.params.items()}
    with pytest.raises(ValueError, match=match):
        engine.load_lora_adapter(named, CONFIG, "a")
    assert all(torch.equal(engine.model.params[n], t) for n, t in before.items())
    assert not engine.adapter.active


def _hf_with_adapter(path: str, targets: list[str], seed: int):
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    inject_adapter_in_model(LoraConfig(r=CONFIG["r"], lora_alpha=CONFIG["lora_alpha"], target_modules=targets), hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts B at zero; a random B makes the adapter change every output
        for name, p in hf.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return hf


@pytest.mark.parametrize(("arch", "targets"), [("llama", "all-linear"), ("llama", ["lm_head", "v_proj"])])
def test_engine_with_adapter_scores_like_peft(model_dirs, arch, targets):
    """The trainer's adapter stream (miles.trainer.lora.adapter_tensors) pushed through the receiver's
    colocated endpoint gives the engine the log-probs of the peft-adapted HF model."""
    from miles.trainer.lora import adapter_tensors
    from miles.weights.tensor_ipc import pack

    hf = _hf_with_adapter(model_dirs[arch], targets, seed=3)
    named = list(adapter_tensors(hf))
    assert named and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n, _ in named)
    ids = list(range(5, 25))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    ref_lp = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]

    async def body():
        engine = EmbeddedEngine(model_dirs[arch])
        await engine.start()
        try:
            packed = pack(named)
            try:
                await WeightReceiver(engine).load_lora_adapter_from_tensors(
                    "miles_lora", CONFIG, packed.payload, weight_version="4"
                )
            finally:
                packed.release()
            out = await engine.generate(
                input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=1
            )
            return engine.weight_version, [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
        finally:
            await engine.shutdown()

    version, got = asyncio.run(body())
    assert version == 4
    assert max(abs(a - b) for a, b in zip(got, ref_lp, strict=True)) <= 1e-4


@pytest.mark.parametrize("colocate", [False, True])
def test_lora_updaters_move_only_the_adapter(model_dirs, colocate):
    """Broadcast (gloo group) and colocated (shared memory) adapter updaters against an engine's receiver:
    each update replaces the adapter, the version follows, and the bytes counted are the adapter's."""
    from miles.config import WeightsConfig
    from miles.weights.registry import make_updater

    path = model_dirs["qwen2"]
    base = _base(path)
    engine = EmbeddedEngine(path)
    receiver = WeightReceiver(engine)
    updater = make_updater(WeightsConfig(), colocate=colocate, lora_config=CONFIG)
    assert type(updater).__name__ == ("LoraColocatedUpdater" if colocate else "LoraBroadcastUpdater")
    try:
        updater.connect([receiver])
        for version, seed in ((1, 5), (2, 6)):
            named = _adapter(base, [Q, DOWN], seed=seed)
            metrics = updater.update(iter(named), version)
            assert metrics["weight_sync/bytes"] == sum(t.numel() * 4 for _, t in named)
            assert engine.weight_version == version
            for m in (Q, DOWN):
                torch.testing.assert_close(
                    engine.model.params[f"{m}.weight"], _merged(base, named, m), rtol=0, atol=1e-5
                )
    finally:
        updater.close()
        asyncio.run(receiver.close())
