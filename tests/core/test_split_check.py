"""``python -m specmemo_core.tools.split_check`` on the CPU path (``cpu,cpu``): a tiny model split in
two gives the whole model's greedy replies at every batch size, plain and speculative, and
reports tokens/s of both on the split model."""

import json

import pytest

from specmemo_core.errors import SplitError
from specmemo_core.tools.split_check import main, parse_torch_devices


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
    from tests.tiny import tiny_hf_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama-4")
    tiny_hf_model(seed=21, layers=4).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_the_check_runs_on_the_cpu_path_and_finds_the_split_equal(tiny_model_folder, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in (
        "Hello, how are you?", "Tell me about the quick brown fox.", "Speculative decoding drafts tokens.")))
    out = tmp_path / "split.json"
    code = main(["--devices", "cpu,cpu", "--model", str(tiny_model_folder), "--heads", "random", "--tree",
                 "1-10-16-17+lookup-8", "--batches", "1,2", "--queries", "3", "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--repeats", "1", "--json", "--out", str(out)])
    found = json.loads(capsys.readouterr().out)
    assert code == 0 and found == json.loads(out.read_text())
    assert found["all_equal"] and set(found["equal"]) == {"plain/b1", "speculative/b1", "plain/b2", "speculative/b2"}
    assert found["layers"] == [2, 2] and found["devices"] == ["cpu", "cpu"] and found["precision"] == "fp32"
    for b in ("1", "2"):
        entry = found["split"][b]
        assert entry["speculative"]["tree"] == "1-10-16-17+lookup-8" and entry["plain"]["tree"] is None
        assert entry["plain"]["tokens_per_s"]["median"] > 0 and entry["speedup"] is not None
        assert entry["speculative"]["identical_to_plain"] == entry["speculative"]["replies"] == 3


@pytest.mark.parametrize("text", ["cuda:0", "cpu", "banana,cpu", ""])
def test_devices_of_the_check_are_two_or_more_torch_devices(text):
    with pytest.raises(SplitError, match="two or more torch devices"):
        parse_torch_devices(text)
