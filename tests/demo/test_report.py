"""The demo's table and summary, from given numbers."""

from lossscale.demo.report import COLUMNS, LEGEND, rows, summary, table
from lossscale.demo.training import RUNS, RunResult


def _results():
    return (
        RunResult(RUNS[0], test_accuracy=0.9861, train_loss=0.00183),
        RunResult(
            RUNS[1],
            test_accuracy=0.35,
            train_loss=11.51281,
            flushed=117,
            nonzero=1000,
            subnormal=800,
            received_nonzero=883,
            gradient_errors=[0.6, 0.75],
        ),
        RunResult(
            RUNS[2],
            test_accuracy=0.98888,
            train_loss=0.0018,
            skipped_steps=[3, 9],
            final_scale=2.0**40,
            flushed=3,
            nonzero=10000,
            subnormal=1,
            received_nonzero=9997,
            gradient_errors=[0.004],
        ),
        RunResult(
            RUNS[3],
            test_accuracy=0.98611,
            train_loss=0.00179,
            skipped_steps=[],
            final_scale=2.0**39,
            flushed=2,
            nonzero=10000,
            subnormal=3,
            received_nonzero=9998,
            gradient_errors=[0.0038],
        ),
    )


def test_rows():
    assert rows(_results()) == [
        ["float32", "98.6 %", "0.0018", "0", "-", "-", "-"],
        ["float16, no loss scaling", "35.0 %", "11.5128", "0", "-", "11.7 %", "67.5 %"],
        ["float16 + LossScaleOptimizer", "98.9 %", "0.0018", "2", "2^40", "0.03 %", "0.4 %"],
        [
            "float16 + LossScaleOptimizer, statistics",
            "98.6 %",
            "0.0018",
            "0",
            "2^39",
            "0.02 %",
            "0.38 %",
        ],
    ]


def test_a_scale_that_is_not_a_power_of_two_prints_plainly():
    result = RunResult(RUNS[2], test_accuracy=1.0, train_loss=0.0, final_scale=1000.0)
    assert rows([result])[0][4] == "1000"


def test_table_is_markdown_with_aligned_columns():
    lines = table(_results()).splitlines()
    assert len(lines) == 6
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(COLUMNS)
    assert set(lines[1]) == {"|", "-"}
    assert len({len(line) for line in lines}) == 1
    assert lines[4].startswith("| float16 + LossScaleOptimizer             | 98.9 %    |")
    assert lines[5].startswith("| float16 + LossScaleOptimizer, statistics | 98.6 %    |")


def test_legend_explains_every_column():
    for column in COLUMNS[1:]:
        assert f"\n{column}: " in "\n" + LEGEND


def test_summary_quotes_the_measured_numbers():
    assert summary(_results()) == (
        "Without loss scaling, float16 flushed 11.7 % of the nonzero gradient values to zero, "
        "90.6 % of the values left were float16 subnormals (below 2^-14: fewer than 10 "
        "significant bits), its gradients were off by 67.5 % on average, and it reached "
        "35.0 % test accuracy. With LossScaleOptimizer, float16 flushed 0.03 %, 0.01 % were "
        "subnormal, it was off by 0.4 %, skipped 2 overflowing step(s) and reached 98.9 % "
        '(float32: 98.6 %). With the "statistics" growth policy it skipped 0 step(s) '
        "instead of 2, ended at scale 2^39, 0.03 % of its values were subnormal, and it "
        "reached 98.6 %."
    )


def test_format_number():
    from lossscale.demo.report import format_number

    assert [format_number(x) for x in (2.0**15, 2.0**-16, 1.0, 1000.0, 1e-5)] == [
        "2^15",
        "2^-16",
        "2^0",
        "1000",
        "1e-05",
    ]
