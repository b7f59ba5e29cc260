"""OffloadedAdamW against torch's AdamW: the same weights after N steps, bit for bit, where promised.

Host moments, fp32 moments on disk and the CPU step (fp32 masters, fp32 gradient buffers) must equal
resident AdamW exactly with the same kernel (AdamW is elementwise; buckets only split the tensors).
bf16 moments on disk round the moments, so they must differ, yet stay close.
"""

from __future__ import annotations

import pytest
import torch

from miles.trainer.offload_optim import OffloadedAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
SHAPES = [(7, 5), (5,), (3, 4, 2), (11,)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _run(opt_fn, steps: int = 4, micro: int = 2) -> list[torch.Tensor]:
    params = _params()
    opt = opt_fn(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(micro):  # gradients accumulate over micro-batches, as in training
            loss = sum((p * torch.randn(p.shape, generator=g)).sum() ** 2 for p in params[:-1])
            loss.backward()  # the last parameter gets no gradient: its state must not move
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params]


def _resident(kernel):
    return lambda ps: torch.optim.AdamW(ps, **HYPER, **kernel)


def _offloaded(placement, kernel, tmp_path=None, **kw):
    disk = str(tmp_path) if tmp_path is not None else None
    return lambda ps: OffloadedAdamW(ps, **HYPER, placement=placement, kernel=kernel, disk_dir=disk, **kw)


KERNELS = [{}, {"foreach": True}, {"fused": True}]


@pytest.mark.parametrize("kernel", KERNELS, ids=["single", "foreach", "fused"])
@pytest.mark.parametrize("bucket_bytes", [40, 1 << 20], ids=["small-buckets", "one-bucket"])
def test_host_moments_equal_resident_bit_for_bit(kernel, bucket_bytes):
    want = _run(_resident(kernel))
    got = _run(_offloaded("host", kernel, bucket_bytes=bucket_bytes))
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


@pytest.mark.parametrize("kernel", KERNELS, ids=["single", "foreach", "fused"])
def test_fp32_moments_on_disk_equal_resident_bit_for_bit(kernel, tmp_path):
    want = _run(_resident(kernel))
    got = _run(_offloaded("disk", kernel, tmp_path, bucket_bytes=64))
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_cpu_step_equals_resident_fused_bit_for_bit():
    want = _run(_resident({"fused": True}))
    got = _run(_offloaded("cpu", {}, bucket_bytes=64))
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_bf16_moments_on_disk_round_but_stay_close(tmp_path):
    want = _run(_resident({}))
    got = _run(_offloaded("disk", {}, tmp_path, moment_dtype=torch.bfloat16))
    assert not all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-3)


class _RoundedMoments(torch.optim.AdamW):
    """Resident AdamW whose moments are rounded to bf16 (to nearest even) after every step."""

    def step(self, closure=None):
        super().step(closure)
        for state in self.state.values():
            for kind in ("exp_avg", "exp_avg_sq"):
                state[kind].copy_(state[kind].to(torch.bfloat16))


@pytest.mark.parametrize("bucket_bytes", [40, 1 << 20], ids=["small-buckets", "one-bucket"])
def test_bf16_moments_on_disk_equal_resident_moments_rounded_each_step(tmp_path, bucket_bytes):
    want = _run(lambda ps: _RoundedMoments(ps, **HYPER))
    got = _run(_offloaded("disk", {}, tmp_path, moment_dtype=torch.bfloat16, bucket_bytes=bucket_bytes))
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_disk_moments_live_in_files_that_go_with_the_optimizer(tmp_path):
    params = _params()
    opt = OffloadedAdamW(params, **HYPER, placement="disk", kernel={}, disk_dir=str(tmp_path))
    files = list(tmp_path.rglob("*.bin"))
    assert sorted(f.name for f in files) == ["exp_avg.bin", "exp_avg_sq.bin"]
    assert all(f.stat().st_size == 4 * sum(p.numel() for p in params) for f in files)
    del opt
    import gc

    gc.collect()
    assert list(tmp_path.rglob("*.bin")) == []


def test_cpu_placement_keeps_gradients_off_dot_grad_and_clips_from_its_buffers():
    params = _params()
    opt = OffloadedAdamW(params, **HYPER, placement="cpu", kernel={})
    (params[0] ** 2).sum().backward()
    assert params[0].grad is None  # moved into the fp32 buffer by the hook
    (grad,) = opt.grad_tensors()
    assert torch.equal(grad, 2 * params[0].detach())
    opt.zero_grad()
    assert opt.grad_tensors() == []


@pytest.mark.parametrize("placement", ["host", "cpu"])
def test_state_dict_round_trip_resumes_identically(placement):
    def steps(opt, params, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            sum((p * torch.randn(p.shape, generator=g)).sum() ** 2 for p in params).backward()
            opt.step()
            opt.zero_grad()

    a_params = _params()
    a = OffloadedAdamW(a_params, **HYPER, placement=placement, kernel={})
    steps(a, a_params, 2, seed=3)
    saved = {k: v for k, v in a.state_dict().items()}
    saved = {"state": {i: {k: t.clone() for k, t in s.items()} for i, s in saved["state"].items()}, **{
        "param_groups": saved["param_groups"]}}  # fmt: skip
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    b = OffloadedAdamW(b_params, **{**HYPER, "lr": 5.0}, placement=placement, kernel={})
    b.load_state_dict(saved)
    assert b.param_groups[0]["lr"] == HYPER["lr"]
    steps(a, a_params, 2, seed=4)
    steps(b, b_params, 2, seed=4)
    for x, y in zip(a_params, b_params, strict=True):
        assert torch.equal(x, y)
