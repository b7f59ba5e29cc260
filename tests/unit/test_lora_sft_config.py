"""Start-up checks of LoRA and SFT runs, the SFT placement, and the supervised data path's token masks."""

from __future__ import annotations

import json

import pytest

from miles.config import ConfigError, DataConfig, WeightsConfig, load_config
from miles.controller.placement import plan_placement
from miles.rollout.prompt_rows import PromptRow
from miles.rollout.sft_data import SupervisedDataSource, chat_tokens, supervised_tokens
from miles.weights.registry import make_updater

from harness import minimal_train_args, requires  # isort: skip

RL = minimal_train_args()
SFT = minimal_train_args(objective=("--loss-type", "sft_loss"))


def errors_of(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(argv))
    return str(info.value)


# ---------------------------------------------------------------- LoRA


@requires("peft")  # --lora-rank is refused at start-up without peft
def test_lora_config_is_accepted_and_read():
    cfg = load_config([*RL, "--lora-rank", "8", "--lora-alpha", "32", "--target-modules", "q_proj,v_proj"])
    assert (cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.target_modules) == (8, 32, "q_proj,v_proj")
    from miles.trainer.lora import lora_settings

    settings = lora_settings(cfg.train)
    assert settings.target_modules == ("q_proj", "v_proj") and settings.scaling == 4.0
    assert lora_settings(load_config(RL).train) is None


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--lora-rank", "-1"], "--lora-rank=-1 must be >= 0"),
        (["--target-modules", "q_proj"], "--target-modules without --lora-rank does nothing"),
        (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha=0 must be positive"),
        (["--lora-rank", "4", "--lora-dropout", "1.0"], "--lora-dropout=1.0 must lie in [0, 1)"),
        (["--lora-rank", "4", "--target-modules", " , "], "names no module"),
        (["--lora-rank", "4", "--update-weight-transfer-mode", "p2p"], "p2p does not carry LoRA adapters"),
        (["--lora-rank", "4", "--update-weight-transfer-mode", "disk-delta"], "disk-delta does not support LoRA"),
        (["--lora-rank", "4", "--engine", "sglang"], "only the embedded engine applies the pushed adapter"),
        (["--lora-rank", "4", "--check-weight-update-equal"], "drop --check-weight-update-equal"),
        (["--lora-rank", "4", "--advantage-estimator", "ppo"], "--advantage-estimator=ppo with --lora-rank"),
        (["--lora-rank", "4", "--train-backend", "megatron"], "LoRA is implemented for the FSDP backend only"),
        (["--lora-merged-forward"], "--lora-merged-forward without --lora-rank does nothing"),
        (["--lora-rank", "4", "--lora-merged-forward", "--lora-dropout", "0.1"], "the merged weight sees the adapter"),
    ],
)
def test_lora_combinations_refused_at_start_up(flags, needle):
    assert needle in errors_of(*RL, *flags)


def test_lora_updaters_refuse_transports_that_cannot_carry_an_adapter():
    for mode in ("p2p", "disk-delta"):
        with pytest.raises(ValueError, match="does not carry LoRA adapters"):
            make_updater(WeightsConfig(update_weight_transfer_mode=mode), lora_config={"r": 4, "lora_alpha": 8})


# ---------------------------------------------------------------- SFT


def test_sft_needs_no_reward_and_plans_no_engine():
    cfg = load_config(SFT)
    cpu = plan_placement(cfg, device="cpu", master_port=29500)
    assert [s.role for s in cpu.specs] == ["trainer"]
    # one GPU is enough: no engine asks for a second one
    gpu = plan_placement(cfg, device="cuda", num_nodes=1, gpus_per_node=1, master_port=29500)
    assert [(w["role"], w["gpus"]) for w in gpu.summary()["workers"]] == [("trainer", [0])]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--rm-type", "math"], "--rm-type='math' with --loss-type sft_loss: SFT trains on the responses"),
        (["--rollout-temperature", "0.7"], "--rollout-temperature=0.7 with --loss-type sft_loss"),
        (["--use-kl-loss"], "--use-kl-loss=True with --loss-type sft_loss"),
        (["--colocate"], "--colocate=True with --loss-type sft_loss: SFT starts no rollout engine"),
        (["--fully-async"], "--fully-async=True with --loss-type sft_loss"),
        (["--n-samples-per-prompt", "4"], "--n-samples-per-prompt=4 with --loss-type sft_loss"),
        (["--eval-interval", "5", "--eval-prompt-data", "e", "/e.jsonl"], "--eval-interval with --loss-type sft_loss"),
        (["--debug-rollout-only"], "--debug-rollout-only=True with --loss-type sft_loss"),
        (["--rollout-function-path", "pkg.mod.fn"], "--rollout-function-path='pkg.mod.fn' with --loss-type sft_loss"),
        (
            ["--dump-details", "d"],
            "config error: --dump-details='d' with --loss-type sft_loss",
        ),  # not the path it sets
    ],
)
def test_sft_refuses_flags_it_would_ignore(flags, needle):
    assert needle in errors_of(*SFT, *flags)


@pytest.fixture(scope="module")
def tokenizer():
    from miles.models.tiny import build_tokenizer

    return build_tokenizer()


def _decode(tokenizer, tokens, mask):
    trained = [t for t, m in zip(tokens[len(tokens) - len(mask) :], mask, strict=True) if m]
    return tokenizer.decode(trained)


def test_text_prompt_and_response_train_on_the_response_and_eos(tokenizer):
    row = PromptRow(prompt="copy 7 :", label="7")
    tokens, mask, n = supervised_tokens(row, DataConfig(), tokenizer)
    assert tokens[: len(tokens) - n] == tokenizer("copy 7 :")["input_ids"]
    assert mask == [1] * n and tokens[-1] == tokenizer.eos_token_id
    assert _decode(tokenizer, tokens, mask) == "7" + tokenizer.eos_token


def test_chat_messages_train_on_every_assistant_turn_only(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "copy 3"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "copy 5"},
        {"role": "assistant", "content": "5"},
    ]
    tokens, mask, n = chat_tokens(messages, tokenizer)
    full = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert tokens == full[: len(tokens)]
    end = tokenizer.eos_token  # the template closes every turn with <|im_end|>
    assert _decode(tokenizer, tokens, mask) == f"3{end}\n5{end}\n"
    untrained = tokenizer.decode([t for t, m in zip(tokens[-n:], mask, strict=True) if not m])
    assert "copy 5" in untrained and "copy 3" not in untrained  # the first user turn is prompt, not response


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([{"role": "user", "content": "hi"}], "no assistant message"),
        ([{"role": "assistant", "content": "hi"}], "starts with an assistant message"),
    ],
)
def test_unusable_conversations_are_refused(tokenizer, messages, needle):
    with pytest.raises(ValueError, match=needle):
        chat_tokens(messages, tokenizer)


def test_text_prompt_without_response_column_is_a_bad_row(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input": "copy 1 :"}) + "\n")
    with pytest.raises(ValueError, match="set --label-key to the response column"):
        SupervisedDataSource(DataConfig(prompt_data=str(path)), tokenizer=tokenizer)


def test_supervised_source_serves_tokenised_samples_in_epochs(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    rows = [{"input": f"copy {d} :", "label": str(d)} for d in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = SupervisedDataSource(DataConfig(prompt_data=str(path), label_key="label"), tokenizer=tokenizer)
    groups = source.get_samples(4)  # wraps into the second epoch
    assert [len(g) for g in groups] == [1, 1, 1, 1] and source.epoch == 1
    for g, d in zip(groups, [0, 1, 2, 0], strict=True):
        s = g[0]
        s.validate()
        assert s.reward == 0.0 and s.response_length == 2 and s.loss_mask == [1, 1]
        assert tokenizer.decode(s.tokens[-2:-1]) == str(d)


@requires("peft")
def test_the_merged_forward_computes_with_the_engines_merged_weight_and_trains_the_adapter():
    """--lora-merged-forward: the layer's output is the engine's merge (W0 + s B A in fp32, as
    engines/embedded/lora.py writes it) rounded to bf16, then one GEMM; A and B get that expression's gradients."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from miles.engines.embedded.lora import AdapterMerger
    from miles.trainer.lora import LoraSettings, apply_lora, use_merged_forward

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(64, 48, bias=True))
    model = model.to(torch.bfloat16)
    apply_lora(model, LoraSettings(rank=4, alpha=16, dropout=0.0, target_modules=("proj",)))
    assert use_merged_forward(model) == 1
    layer = model.proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        b.normal_(0, 0.05)  # peft starts B at 0, where any form agrees
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    kept = {t.data_ptr() for t in (x, layer.base_layer.weight, a, b)}
    assert {t.data_ptr() for t in saved} == kept  # no merged weight waits for the backward

    served = {"proj.weight": layer.base_layer.weight.detach().clone()}  # the engine's copy, merged in place
    AdapterMerger(served).load([("proj.lora_A.weight", a.detach()), ("proj.lora_B.weight", b.detach())],
                               {"r": 4, "lora_alpha": 16}, "step-1")  # fmt: skip
    assert torch.equal(out, F.linear(x, served["proj.weight"], layer.base_layer.bias))  # bit for bit

    grad = torch.randn_like(out)
    out.backward(grad)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    w0 = layer.base_layer.weight.detach()
    F.linear(x, torch.addmm(w0.float(), b2.float(), a2.float(), alpha=4.0).to(x.dtype)).backward(grad)
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad) and a.grad.abs().sum() > 0
    assert layer.base_layer.weight.grad is None  # the base stays frozen
