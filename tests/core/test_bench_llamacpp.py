"""specmemo bench's llamacpp method (tools/bench_llamacpp.py): left out with a line that says
why where it cannot run, refused on a model that is not a GGUF file."""

from __future__ import annotations

import json

import pytest

from specmemo_core.cli.main import main
from specmemo_core.errors import SpecMemoError
from specmemo_core.tools.bench_llamacpp import gguf_path, missing_reason
from tests.tiny import save_tiny_model_folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = save_tiny_model_folder(tmp_path_factory.mktemp("tiny-llamacpp"), layers=2)
    (folder / "prompts.jsonl").write_text(json.dumps({"turns": ["Hello, how are you today?"]}) + "\n")
    return folder


def _bench(folder, methods):
    return ["bench", "--model", str(folder), "--heads", "random", "--prompts", str(folder / "prompts.jsonl"),
            "--queries", "1", "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--device", "cpu",
            "--json", "--methods", methods]


def test_llamacpp_is_left_out_with_a_line_where_it_is_not_installed_else_it_wants_a_gguf(tiny_folder, capsys):
    code = main(_bench(tiny_folder, "vanilla,llamacpp"))
    captured = capsys.readouterr()
    if missing_reason() is not None:  # CI: llama-cpp-python is an optional extra
        assert code == 0
        assert "llamacpp skipped: llama-cpp-python is not installed" in captured.err
        assert "pip install -e '.[llamacpp]'" in captured.err
        out = json.loads(captured.out.strip().splitlines()[-1])
        assert [k for k in out if not k.startswith("_")] == ["vanilla"]
        assert out["_run"]["skipped"][0]["method"] == "llamacpp"
    else:  # installed: a model folder is no GGUF, which llama.cpp reads
        assert code != 0 and "reads GGUF files" in captured.err


def test_llamacpp_alone_is_refused_where_it_cannot_run(tiny_folder, capsys):
    code = main(_bench(tiny_folder, "llamacpp"))
    err = capsys.readouterr().err
    assert code != 0
    assert ("not installed" in err) if missing_reason() is not None else ("reads GGUF files" in err)


def test_gguf_path_takes_gguf_files_only(tmp_path):
    assert gguf_path(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    with pytest.raises(SpecMemoError, match="GGUF"):
        gguf_path(str(tmp_path))


def test_a_llama_cpp_that_fails_on_the_file_is_reported_not_crashing_the_bench(tmp_path):
    """The probe runs in a child process: a file llama.cpp cannot read (or no llama.cpp at
    all) gives a reason, and this process lives on."""
    from specmemo_core.tools.bench_llamacpp import crash_reason

    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    reason = crash_reason(bogus, 1)
    assert reason is not None and reason.startswith("llamacpp skipped: llama.cpp failed on a 7-token prompt")
