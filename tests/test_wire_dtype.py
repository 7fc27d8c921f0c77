"""The reducer's wire-dtype probe (accelerate_c.strategies.ddp._wire_dtype): only the backend's refusal of a
dtype means "all-reduce in fp32"; a timeout or a dead peer is raised, naming the probe, and
nothing is cached. Run on a real one-process gloo group; gloo itself supplies the refusal."""
import pytest
import torch
import torch.distributed as dist

from accelerate_c.strategies import ddp


@pytest.fixture
def gloo(tmp_path, monkeypatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    monkeypatch.setattr(ddp, "_WIRE", {})  # decisions cached by earlier tests
    yield
    dist.destroy_process_group()


def _gloo_refusal() -> RuntimeError:
    """What gloo raises for a dtype it cannot reduce (float8 in torch 2.13)."""
    with pytest.raises(RuntimeError) as info:
        dist.all_reduce(torch.zeros(1, dtype=torch.float8_e4m3fn))
    return info.value


def test_supported_and_unsupported_dtypes_as_gloo_answers(gloo):
    dist.all_reduce(torch.zeros(1, dtype=torch.bfloat16))  # gloo takes bf16...
    assert ddp._wire_dtype(torch.zeros(3, dtype=torch.bfloat16)) == torch.bfloat16
    _gloo_refusal()  # ...and refuses float8
    assert ddp._wire_dtype(torch.zeros(3, dtype=torch.float8_e4m3fn)) == torch.float32


def test_a_refusal_worded_as_gloo_words_it_means_fp32(gloo, monkeypatch):
    refusal = _gloo_refusal()

    def refuse(*args, **kwargs):
        raise RuntimeError(str(refusal))

    monkeypatch.setattr(dist, "all_reduce", refuse)
    assert ddp._wire_dtype(torch.zeros(3, dtype=torch.float16)) == torch.float32


def test_a_timeout_in_the_probe_is_raised_and_not_cached(gloo, monkeypatch):
    calls, real = [], dist.all_reduce

    def time_out(*args, **kwargs):
        calls.append(args[0].dtype)
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                           "1800000ms for recv operation to complete")

    monkeypatch.setattr(dist, "all_reduce", time_out)
    with pytest.raises(RuntimeError, match=r"rank 0: the 1-element torch.float16 all-reduce .* gloo backend .*"
                                           r"Timed out waiting") as info:
        ddp._wire_dtype(torch.zeros(3, dtype=torch.float16))
    assert "Timed out" in str(info.value.__cause__)
    monkeypatch.setattr(dist, "all_reduce", real)  # the peer is back: the next probe asks again, gets fp16
    assert ddp._wire_dtype(torch.zeros(3, dtype=torch.float16)) == torch.float16
    assert calls == [torch.float16]
