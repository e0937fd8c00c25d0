"""`bench data --decode-only` (convit_scale/bench/crop_decode.py): the whole JPEG's decode beside the crop box's."""


def test_crop_decode_bench_times_the_whole_decode_beside_the_box(tmp_path):
    """`bench data --decode-only`'s measurement at test size: both candidates on the same JPEGs, every box decoded
    by the crop-region decoder (none refused)."""
    from test_jpeg import encode, photo_like

    from convit_scale.bench.crop_decode import crop_decode_costs

    (tmp_path / "train" / "c0").mkdir(parents=True)
    for k in range(3):
        (tmp_path / "train" / "c0" / f"{k}.JPEG").write_bytes(encode(photo_like(75, 100, seed=k), quality=90))
    res = crop_decode_costs(str(tmp_path), 0.02)
    assert res["images"] == 3 and res["box_refused"] == 0 and res["box_decodes"] >= 3 * 2
    for kind in ("decode", "with_resize", "webdataset"):
        assert res[kind]["whole_cpu_ms_per_image"] > 0 and res[kind]["box_cpu_ms_per_image"] > 0
        assert res[kind]["whole_vs_box"] > 0
