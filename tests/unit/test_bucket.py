import pytest
import torch

from miles.weights.bucket import bucket_meta, iter_buckets, pipelined


def _named(sizes_bytes: list[int]) -> list[tuple[str, torch.Tensor]]:
    # float32: 4 bytes per element
    return [(f"t{i}", torch.zeros(n // 4)) for i, n in enumerate(sizes_bytes)]


def test_buckets_flush_before_passing_the_limit():
    buckets = list(iter_buckets(_named([40, 40, 40, 100, 8, 8]), bucket_bytes=100))
    # 40+40=80, +40 would pass 100 -> flush; 40 alone, +100 passes -> flush; 100 alone (equal is fine)
    # then 100+8 passes -> flush; 8+8.
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]


def test_oversized_tensor_travels_alone():
    buckets = list(iter_buckets(_named([8, 400, 8]), bucket_bytes=100))
    assert [[n for n, _ in b] for b in buckets] == [["t0"], ["t1"], ["t2"]]


def test_duplicate_name_is_refused():
    with pytest.raises(ValueError, match="appears twice"):
        list(iter_buckets([("a", torch.zeros(2)), ("a", torch.zeros(2))], bucket_bytes=100))


def test_non_contiguous_tensors_become_contiguous():
    t = torch.arange(12.0).reshape(3, 4).t()
    [[(_, out)]] = list(iter_buckets([("x", t)], bucket_bytes=1000))
    assert out.is_contiguous() and torch.equal(out, t)


def test_bucket_meta_names_dtypes_shapes():
    meta = bucket_meta([("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(5))])
    assert (meta.names, meta.dtypes, meta.shapes) == (["a", "b"], ["bfloat16", "float32"], [[2, 3], [5]])
    assert meta.nbytes == 2 * 3 * 2 + 5 * 4


def test_pipeline_prepares_next_bucket_while_previous_in_flight():
    events: list[str] = []

    def stream():
        for i in range(3):
            events.append(f"prepare{i}")
            yield [(f"t{i}", torch.zeros(1))]

    def start(bucket):
        name = bucket[0][0]
        events.append(f"start:{name}")
        return lambda: events.append(f"finish:{name}")

    assert pipelined(stream(), start) == 3
    assert events == [
        "prepare0",
        "start:t0",
        "prepare1",
        "finish:t0",
        "start:t1",
        "prepare2",
        "finish:t1",
        "start:t2",
        "finish:t2",
    ]


def test_pipeline_finishes_in_flight_bucket_when_preparation_fails():
    finished = []

    def stream():
        yield [("a", torch.zeros(1))]
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        pipelined(stream(), lambda b: lambda: finished.append(b[0][0]))
    assert finished == ["a"]
