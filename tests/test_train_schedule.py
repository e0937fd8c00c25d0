"""convit_scale/train/schedule.py: the learning rate as a pure function of the step."""

import math

from convit_scale.config import ScheduleConfig
from convit_scale.train.schedule import lr_at, peak_lr


def test_schedule_against_hand_written_table():
    s = ScheduleConfig(epochs=10, warmup_epochs=2, warmup_lr=1e-6, min_lr=1e-5)
    peak = 1e-3
    # steps_per_epoch 10: warmup over steps 0..19, cosine over 20..99
    table = {0: 1e-6, 10: 1e-6 + (1e-3 - 1e-6) * 0.5, 20: 1e-3, 60: 1e-5 + 0.5 * (1e-3 - 1e-5), 100: 1e-5, 150: 1e-5}
    for step, want in table.items():
        assert math.isclose(lr_at(step, peak, 10, s), want, rel_tol=1e-12), step
    assert lr_at(99, peak, 10, s) > 1e-5
    assert peak_lr(5e-4, 1024) == 1e-3 and peak_lr(4e-4, 512) == 4e-4
