"""convit_scale/parallel/zero_config.py: the ZeRO config the engine writes (and the planner reads)."""

from __future__ import annotations

import pytest


def test_buckets_sized_from_the_model_are_aligned_and_odd_ones_refused():
    """A tenth of ConViT-B+ (153,134,856 parameters) is odd, which DeepSpeed's ZeRO-1/2 refuse at start-up on every
    rank ("allgather_bucket_size must be a multiple of nccl_start_alignment_factor"): rounded up to a multiple of 8;
    an explicit odd size is refused with the recipe."""
    from convit_scale.config import ConfigError, load_config
    from convit_scale.parallel.zero_config import zero_sizes

    for device in ("cpu", "cuda"):
        bucket = zero_sizes(load_config(None, ["parallel.strategy=zero2"]).parallel, 153_134_856, device)["bucket"]
        assert bucket % 8 == 0 and 0 <= bucket - 153_134_856 / 10 < 8
    with pytest.raises(ConfigError, match="parallel.zero_bucket_elements = 1001 is not allowed; must be a positive "
                                          "multiple of 8"):
        load_config(None, ["parallel.strategy=zero2", "parallel.zero_bucket_elements=1001"])


def test_deepspeeds_bf16_overflow_check_is_switched_off_in_its_own_terms():
    """The switch is written only when asked and only under bf16, and DeepSpeed's own config parser reads it (where its
    release has the key: the strategy asks only then)."""
    from convit_scale.config import load_config
    from convit_scale.parallel.zero_config import deepspeed_config
    from convit_scale.parallel.zero_engine import knows_bf16_overflow_switch

    def bf16(precision, check):
        p = load_config(None, ["parallel.strategy=zero2", f"parallel.precision={precision}"]).parallel
        return deepspeed_config(p, 4, 1, 2, 10**6, bf16_overflow_check=check)["bf16"]

    assert bf16("bf16", True) == {"enabled": True} and bf16("fp32", False) == {"enabled": False}
    assert bf16("bf16", False) == {"enabled": True, "check_grad_overflow": False}
    if knows_bf16_overflow_switch():
        from deepspeed.runtime.precision_config import get_bfloat16_config

        assert get_bfloat16_config({"bf16": bf16("bf16", False)}).check_grad_overflow is False


def test_a_universal_scratch_folder_needs_a_zero_strategy():
    from convit_scale.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="parallel.zero_universal_scratch = '/local' is not allowed; needs "
                                          "parallel.strategy zero1, zero2 or zero3"):
        load_config(None, ["parallel.strategy=fsdp2", "parallel.zero_universal_scratch=/local"])


def test_deepspeeds_throughput_timer_is_off_in_the_engine():
    """DeepSpeed's throughput timer calls the accelerator's synchronize() at the start and the end of every step from
    step 2 on: two host waits per ZeRO step. The generated config turns it off, and DeepSpeed's own parser reads it
    so (the engine builds its ThroughputTimer from ``timers_config``)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils.timer import ThroughputTimer

    from convit_scale.config import load_config
    from convit_scale.parallel.zero_config import deepspeed_config

    p = load_config(None, ["parallel.strategy=zero2"]).parallel
    ds = DeepSpeedConfig(deepspeed_config(p, 4, 1, 1, 10**6), mpu=None)
    assert ds.timers_config.enabled is False
    timer, syncs = ThroughputTimer(ds.timers_config, batch_size=4), []
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    real = accelerator.synchronize
    accelerator.synchronize = lambda *a, **k: syncs.append(1)
    try:
        for _ in range(4):
            timer.start()
            timer.stop(global_step=True)
    finally:
        accelerator.synchronize = real
    assert syncs == []
