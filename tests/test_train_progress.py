"""What rank 0 shows of training (convit_scale/train/progress.py): one plain line per logged step off a terminal,
nothing on the other ranks."""

from __future__ import annotations

from convit_scale.train.progress import Progress, step_line

REC = {"step": 100, "epoch": 2, "loss": 2.34567, "lr": 5e-4, "images_per_s": 1234.4, "step_time_s": 0.25,
       "peak_mem_mb": [900.0, 1024.4], "grad_norm": 1.23456}


def test_a_step_line_says_step_loss_lr_speed_eta_and_memory():
    assert step_line(REC, 1000) == ("[convit-scale] step 100/1000 | epoch 2 | loss 2.3457 | lr 5.000e-04 | 1234 img/s "
                                    "| 0.250 s/step | eta 3m45s | mem 1024 MB | grad norm 1.23")
    long = step_line({**REC, "loss": None, "grad_norm": None, "peak_mem_mb": []}, 100 + 4 * 3600 * 4 + 8)
    assert "loss skipped (non-finite)" in long and "eta 4h00m" in long and "mem 0 MB" in long
    assert "grad norm" not in long
    assert "crop decoder" not in step_line({**REC, "crop_boxes_decoded": 5000, "crop_decode_refused": 0}, 1000)
    assert step_line({**REC, "crop_decode_refused": 3}, 1000).endswith(
        "| grad norm 1.23 | crop decoder refused 3 JPEG(s) since the start")
    assert step_line({**REC, "device_decode_refused": 2}, 1000).endswith(
        "| device decoder refused 2 JPEG(s), decoded on the host")


def test_lines_on_rank_zero_off_a_terminal_and_nothing_elsewhere(capsys):
    # pytest captures stdout: not a terminal, so rank 0 prints lines even when a bar is wanted
    with Progress.for_run(is_main=True, want_bar=True, total=1000, start=99) as main:
        main.advance(100)
        main.log_step(REC, 1000)
    with Progress.for_run(is_main=False, want_bar=True, total=1000, start=99) as other:
        other.advance(100)
        other.log_step(REC, 1000)
    assert capsys.readouterr().out.splitlines() == [step_line(REC, 1000)]
