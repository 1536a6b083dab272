"""The bench chart (Qt, in the GUI package): a PNG from a report, and from its JSON."""

import json

from PySide6.QtGui import QImage

from app.bench_plot import main, plot_png
from specmemo_core.tools.bench import Method, Pass, report


def _pass(seconds: float) -> Pass:
    return Pass([[1, 2, 3], [4, 5]], 5, seconds, 2, 3, (0.1, 0.1))


def _report() -> dict:
    methods = [Method("hf", lambda: None), Method("vanilla", lambda: None), Method("plan", lambda: None)]
    passes = {"hf": [_pass(2.0), _pass(1.0)], "vanilla": [_pass(1.0), _pass(0.8)], "plan": [_pass(0.5), _pass(0.4)]}
    return report(methods, passes)


def test_plot_is_a_png_of_nonzero_size(tmp_path, qapp):
    path = plot_png(_report(), tmp_path / "sub" / "bench.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    image = QImage(str(path))
    assert image.width() >= 640 and image.height() > 0


def test_plot_from_the_bench_json(tmp_path, qapp, capsys):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({**_report(), "_run": {"model": "m", "device": "cpu", "dtype": "fp32"}}))
    assert main([str(src), str(tmp_path / "b.png")]) == 0
    assert QImage(str(tmp_path / "b.png")).width() >= 640
    assert main([str(tmp_path / "missing.json"), str(tmp_path / "c.png")]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_bench_draws_its_chart_in_a_child_process(tmp_path, qapp):
    """``specmemo bench --plot``: the core hands the report to ``app.bench_plot`` in a
    child process (it never imports Qt itself); a failure there is an error that says why."""
    import pytest

    from specmemo_core.tools.bench import plot_report
    from specmemo_core.errors import SpecMemoError

    path = plot_report(_report(), tmp_path / "chart.png")
    assert QImage(str(path)).width() >= 640
    with pytest.raises(SpecMemoError, match="could not draw the chart"):
        plot_report({"_run": {}}, tmp_path / "empty.png")  # no methods: nothing to plot


def test_bench_refuses_a_plot_name_that_is_not_a_png_before_loading(capsys):
    from specmemo_core.cli import main as cli_main

    assert cli_main(["bench", "--methods", "vanilla", "--plot", "chart.jpg"]) == 2
    assert ".png" in capsys.readouterr().err
