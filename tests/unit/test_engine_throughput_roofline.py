"""bench/engine_throughput.py's decode roofline divides by the device's own HBM bandwidth: an H100's figure
against an H200's bandwidth read 0.23 where the device ran at 0.33 of its own."""

import pytest

from bench_modules import load_bench  # isort: skip  (same folder, rootdir on sys.path)

bench = load_bench("engine_throughput")


@pytest.mark.parametrize(
    "name, gbps",
    [
        ("NVIDIA H200", 4800.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H100 NVL", 3900.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
    ],
)
def test_the_roofline_takes_the_device_s_own_bandwidth(name, gbps):
    assert bench.device_hbm_gbps(name) == gbps


def test_an_unknown_device_is_refused_with_the_flag_to_pass():
    with pytest.raises(ValueError, match="--hbm-gbps"):
        bench.device_hbm_gbps("NVIDIA GeForce RTX 4090")


def test_the_flag_defaults_to_the_device_and_overrides_it():
    assert bench.parse_args([]).hbm_gbps is None
    assert bench.parse_args(["--device", "cuda", "--hbm-gbps", "3000"]).hbm_gbps == 3000.0


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--hbm-gbps", "3000"], "--hbm-gbps sets the decode roofline"),
        (["--skip-hf", "--hf-cache-implementation", "static"], "--hf-cache-implementation sets the transformers side"),
    ],
)
def test_flags_with_nothing_to_act_on_are_refused(argv, says, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)  # on CPU, the bench's default device
    assert says in capsys.readouterr().err
