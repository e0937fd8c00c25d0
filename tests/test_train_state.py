"""convit_scale/train/state.py: what a checkpoint keeps of where the run is."""

from convit_scale.train.state import TrainState


def test_best_top1_is_recorded_and_survives_a_resume():
    state = TrainState()
    assert state.record_eval(0, {"top1": 50.0, "top5": 90.0})["best_top1"] == 50.0
    assert state.record_eval(1, {"top1": 60.0, "top5": 91.0})["best_epoch"] == 1
    after = state.record_eval(2, {"top1": 55.0, "top5": 95.0})
    assert (after["top1"], after["best_top1"], after["best_top5"], after["best_epoch"]) == (55.0, 60.0, 91.0, 1)
    resumed = TrainState.from_meta(state.to_meta(accum=1, world_size=2), accum=1, world_size=2)
    assert resumed.record_eval(3, {"top1": 58.0, "top5": 96.0})["best_top1"] == 60.0
