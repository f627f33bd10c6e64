"""The anchor scripts' own arithmetic (bench/anchors/): the byte share charged to HF's
quantized cache, read from a real QuantizedCache, and the report's intervals and its
monotonicity rule. The anchors' figures in QUALITY.md rest on these."""

import math
import os
import sys

import pytest

ANCHORS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "anchors")
sys.path.insert(0, os.path.abspath(ANCHORS))

import anchor_common  # noqa: E402
import report  # noqa: E402


def test_quantized_cache_share_counts_bits_scales_and_the_residual():
    # int4: 4 bits + an f16 scale and zero-point per 64 elements, over 16 bits.
    assert anchor_common.quantized_cache_share(4) == pytest.approx(4.5 / 16)
    assert anchor_common.quantized_cache_share(2) == pytest.approx(2.5 / 16)
    # 100 quantized tokens and 28 at full precision.
    assert anchor_common.quantized_cache_share(2, 100, 28) == pytest.approx((100 * 2.5 / 16 + 28) / 128)
    assert anchor_common.quantized_cache_share(4, 0, 0) == 1.0


def test_quantized_fraction_reads_a_real_quantized_cache():
    torch = pytest.importorskip("torch")
    pytest.importorskip("optimum.quanto")
    from transformers import LlamaConfig
    import kvpress_quality as kq

    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      hidden_size=256)

    class Model:  # make_cache reads only the config
        config = cfg

    for bits in (4, 2):
        cache = kq.make_cache(Model, ("quanto", bits))
        for layer in range(2):
            k = torch.randn(1, 2, 300, 64)
            cache.update(k, k.clone(), layer)
        # After a prefill every token is quantized, in groups of 64 elements of one token
        # and head, each with a scale and a zero-point (what the share counts).
        q = cache.layers[0]._quantized_keys
        assert q._scale.numel() == 2 * 300 and q._shift.numel() == 2 * 300
        assert kq.quantized_fraction(cache, bits) == pytest.approx((bits + 0.5) / 16)
        # A decode step's token joins the full-precision residual.
        for layer in range(2):
            x = torch.randn(1, 2, 1, 64)
            cache.update(x, x.clone(), layer)
        assert kq.quantized_fraction(cache, bits) == pytest.approx((300 * (bits + 0.5) / 16 + 1) / 301)


def test_parse_quantized_names_its_argument():
    import kvpress_quality as kq
    assert kq.parse_quantized("quanto:4,hqq:2") == [("quanto", 4), ("hqq", 2)]
    with pytest.raises(SystemExit, match="--quantized"):
        kq.parse_quantized("quanto")
    with pytest.raises(SystemExit, match="--quantized"):
        kq.parse_quantized("bnb:4")


def test_wilson_interval():
    lo, hi = report.wilson(20, 20)
    assert hi == 1.0 and lo == pytest.approx(0.839, abs=1e-3)
    lo, hi = report.wilson(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.161, abs=1e-3)
    lo, hi = report.wilson(10, 20)
    assert lo == pytest.approx(0.299, abs=1e-3) and hi == pytest.approx(0.701, abs=1e-3)
    assert report.wilson(0, 0) == (0.0, 1.0)
    assert all(not math.isnan(x) for x in report.wilson(7, 9))


def test_drops_flags_only_a_fall_beyond_the_interval():
    # 20/20 at 5%, then 10/20 at 10%: 10/20's upper bound (70%) is under 100%.
    assert report.drops([(0.05, 20, 20), (0.10, 10, 20)]) == [((0.05, 20, 20), (0.10, 10, 20))]
    # 17/20 then 16/20: within the interval.
    assert report.drops([(0.05, 17, 20), (0.10, 16, 20)]) == []
    # Rising, or a drop to a smaller share, is not a drop as the budget grows.
    assert report.drops([(0.10, 20, 20), (0.05, 5, 20)]) == []
    # Not only neighbours: 2.5% at 20/20 against 20% at 9/20, with 15/20 between.
    found = report.drops([(0.025, 20, 20), (0.10, 15, 20), (0.20, 9, 20)])
    assert ((0.025, 20, 20), (0.20, 9, 20)) in found


def test_t975_matches_students_t():
    # Exact 0.975 quantiles: df 6 2.447, df 17 2.110, df 100 1.984.
    assert report.t975(6) == pytest.approx(2.447, abs=0.01)
    assert report.t975(17) == pytest.approx(2.110, abs=0.005)
    assert report.t975(100) == pytest.approx(1.984, abs=0.002)


def test_paired_compares_each_side_against_its_own_full_cache():
    def row(side, config, pid, ppl, fraction=1.0):
        return {"side": side, "task": "ppl-prefix", "id": pid, "config": config,
                "fraction": fraction, "nll_sum": math.log(ppl) * 100, "scored": 100}
    rows = []
    # kvgc at 10%: 1.05x, 1.02x, 1.08x of its full cache; q4_0: 1.04x on each.
    for pid, full, ratio in (("a", 30.0, 1.05), ("b", 20.0, 1.02), ("c", 40.0, 1.08)):
        rows += [row("kvgc", "full", pid, full), row("kvgc", "default@bytes", pid, full * ratio, 0.1),
                 row("llama.cpp", "f16", pid, full * 0.9), row("llama.cpp", "q4_0", pid, full * 0.9 * 1.04, 0.28125)]
    rows.append(row("kvgc", "default@bytes", "d", 50.0, 0.1))  # no q4_0 nor full: left out
    st = report.paired_stats(rows, "ppl-prefix", ("kvgc", "default@bytes", 0.1), ("llama.cpp", "q4_0", 0.28125))
    assert st["prompts"] == 3 and st["a_lower"] == 1 and st["a_higher"] == 2
    assert st["diff"] == pytest.approx((0.01 - 0.02 + 0.04) / 3)
    d = [0.01, -0.02, 0.04]
    sd = math.sqrt(sum((x - st["diff"]) ** 2 for x in d) / 2)
    assert st["hi"] - st["diff"] == pytest.approx(report.t975(2) * sd / math.sqrt(3))
    # Another fraction, or a cell with one prompt, gives nothing to compare.
    assert report.paired_stats(rows, "ppl-prefix", ("kvgc", "default@bytes", 0.2), ("llama.cpp", "q4_0", 0.28125)) is None
    assert report.parse_cell("llama.cpp:q4_0:0.28125") == ("llama.cpp", "q4_0", 0.28125)
    with pytest.raises(SystemExit, match="--paired"):
        report.parse_cell("q4_0")
