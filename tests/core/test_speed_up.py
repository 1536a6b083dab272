"""Heads for the user's own model (tools/train/speed_up.py): the job, its estimate, cancel and
resume, and the default heads finding what was trained here. Real code on a tiny model."""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import replace

import pytest
import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.storage.datasets import load_prompt_file
from specmemo_core.storage.trained_heads import finished, trained_heads_dir
from specmemo_core.tools.train.speed_up import (SHIPPED_HELDOUT, SHIPPED_PROMPTS, TrainingCancelled,
                                                base_model_for, estimate_training, speed_up_job,
                                                train_speed_up_heads)
from specmemo_core.tools.train.trainer import TrainConfig
from tests.tiny import save_tiny_model_folder


@pytest.fixture
def tiny_job(tmp_path, monkeypatch):
    """A speed-up job for a tiny model folder, shrunk to seconds."""
    data = tmp_path / "data"
    monkeypatch.setenv("SPECMEMO_DATA_DIR", str(data))
    folder = save_tiny_model_folder(tmp_path / "tiny-llama", layers=2, seed=3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"Hello number {i}, how are you?"]}) for i in range(8)))
    hf, name, fingerprint = base_model_for(str(folder), "cpu")
    job = speed_up_job(str(folder), name=name, fingerprint=fingerprint, device="cpu", data_folder=data,
                       prompts_file=prompts)
    job = replace(job, config=replace(job.config, train_prompts=6, heldout_prompts=3, max_new_tokens=16, gen_batch=4,
                                      heldout_file=str(prompts),
                                      train=TrainConfig(steps=24, batch_size=64, checkpoint_every=4)))
    return job, hf, folder


def test_the_default_job_trains_like_the_shipped_heads_into_the_data_folder(tmp_path):
    job = speed_up_job("default", name="Smol LM/2", fingerprint="ab12", device="cuda", data_folder=tmp_path)
    assert job.out == tmp_path / "heads" / "Smol_LM_2-ab12"
    cfg = job.config
    assert (cfg.kind, cfg.num_heads, cfg.context, cfg.context_next, cfg.draft_vocab, cfg.train.steps) == (
        "hydra", 4, True, True, 8192, 4000)
    assert cfg.prompts_file == str(SHIPPED_PROMPTS) and cfg.gen_batch == 256
    assert speed_up_job("default", name="m", fingerprint="f", device="cpu", data_folder=tmp_path).config.gen_batch == 16


def test_the_shipped_prompt_files_hold_the_training_and_held_out_prompts():
    assert len(load_prompt_file(SHIPPED_PROMPTS)) == 8000
    held = load_prompt_file(SHIPPED_HELDOUT)
    assert len(held) == 210 and sum(len(t) == 2 for t in held) == 70  # MT-Bench 11-80, both turns


def test_gzipped_prompt_files_split_only_at_newlines(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress('{"turns": ["a\u2028b"]}\n{"turns": ["c"]}\n'.encode()))
    assert load_prompt_file(path) == [["a\u2028b"], ["c"]]


def test_estimate_multiplies_timed_steps_out(tiny_job):
    job, hf, _ = tiny_job
    est = estimate_training(job, hf, heldout_replies=3)
    times = est.step_times
    assert set(est.stages) == {"replies", "hidden states", "training", "calibration"}
    assert est.stages["training"] == pytest.approx(24 * times["train_step_s"])
    assert est.stages["replies"] == pytest.approx(2 * (times["prefill_s"] + 16 * times["per_token_s"]))
    assert est.total_s == pytest.approx(sum(est.stages.values())) and est.total_s > 0
    assert est.features_bytes == 6 * (96 + 200) * hf.config.hidden_size * 2 * 2
    assert "about" in est.describe()


def test_cancel_keeps_the_work_and_a_second_run_resumes_to_the_same_heads(tiny_job, tmp_path):
    from safetensors.torch import load_file

    job, _, folder = tiny_job
    cancel, stages = threading.Event(), []

    def progress(stage, fraction):
        stages.append((stage, fraction))
        if stage == "training heads" and fraction >= 0.5:
            cancel.set()

    with pytest.raises(TrainingCancelled):
        train_speed_up_heads(job, progress=progress, cancel=cancel)
    assert not finished(job.out) and job.started and (job.out / "checkpoint.pt").exists()
    assert (job.out / "distill.safetensors").exists()  # the replies are kept
    card = train_speed_up_heads(job)  # resumes: the replies and the checkpoint are reused
    assert finished(job.out) and not job.started and card["kind"] == "hydra"
    fresh = replace(job, out=tmp_path / "uninterrupted")
    train_speed_up_heads(fresh)
    resumed, whole = load_file(str(job.out / "heads.safetensors")), load_file(str(fresh.out / "heads.safetensors"))
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_half_trained_folder_refuses_another_job(tiny_job):
    job, _, _ = tiny_job
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TrainingCancelled):
        train_speed_up_heads(job, cancel=cancel)
    other = replace(job, config=replace(job.config, train=replace(job.config.train, steps=30)))
    with pytest.raises(SpecMemoError, match="half-trained"):
        train_speed_up_heads(other)


def test_the_default_heads_are_the_ones_trained_here_once_finished(tiny_job):
    from specmemo_core.runtime.engine import Engine

    job, _, folder = tiny_job
    assert Engine.load(str(folder)).heads is None  # a tiny model ships no heads
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TrainingCancelled):
        train_speed_up_heads(job, cancel=cancel)
    assert Engine.load(str(folder)).heads is None  # half-done heads are never used
    train_speed_up_heads(job)
    engine = Engine.load(str(folder), tree="calibrated-8+lookup-3")
    assert engine.heads_folder == job.out == trained_heads_dir(job.out.parents[1], engine.identity.name,
                                                               engine.identity.fingerprint)
    plain = Engine.load(str(folder), heads="none")
    spoken = "".join(p.text for p in engine.new_session(512).send("Hello number 3"))
    assert spoken == "".join(p.text for p in plain.new_session(512).send("Hello number 3"))


def test_training_memory_is_checked_from_the_shape_before_anything_loads(tmp_path):
    from specmemo_core.planning.memory import known_shape
    from specmemo_core.tools.train.speed_up import (TrainingDoesNotFitError, check_training_fits,
                                                    hidden_states_bytes, training_memory)

    gib = 2**30
    llama = known_shape("llama-3-8b")
    cpu = speed_up_job("x.gguf", name="m", fingerprint="f", device="cpu", data_folder=tmp_path)
    memory = training_memory(llama, cpu)
    assert memory.weights_bytes == llama.params * 4 and memory.device_bytes == 0
    assert memory.hidden_bytes == hidden_states_bytes(4096, cpu.config, 8000) == 8000 * 296 * 4096 * 2 * 2
    with pytest.raises(TrainingDoesNotFitError, match="RAM.*does not leave room"):  # a 16 GB laptop
        check_training_fits(llama, cpu, free_ram=16 * gib, free_device=None)
    with pytest.raises(TrainingDoesNotFitError, match=r"--prompts (\d+)") as refused:
        check_training_fits(llama, cpu, free_ram=100 * gib, free_device=None)
    fits = int(refused.value.args[0].split("--prompts ")[1].split(",")[0].split(")")[0])
    assert 0 < fits < 8000 and fits % 100 == 0
    assert check_training_fits(llama, cpu, free_ram=100 * gib, free_device=None, replies=fits).replies == fits
    with pytest.raises(TrainingDoesNotFitError):
        check_training_fits(llama, cpu, free_ram=100 * gib, free_device=None, replies=fits + 100)
    gpu = speed_up_job("x.gguf", name="m", fingerprint="f", device="cuda", data_folder=tmp_path)
    with pytest.raises(TrainingDoesNotFitError, match="GPU memory"):  # bf16 weights alone are 16 GB
        check_training_fits(llama, gpu, free_ram=200 * gib, free_device=12 * gib)
    smol = known_shape("smollm2-135m")
    assert check_training_fits(smol, cpu, free_ram=20 * gib, free_device=None).host_bytes < 8 * gib


def test_speed_up_refuses_a_model_this_computer_cannot_train_before_reading_it(capsys):
    from specmemo_core.cli.main import main

    code = main(["speed-up", "--model", "shape:llama-3-8b", "--estimate", "--device", "cpu"])
    assert code != 0
    assert "GiB of RAM" in capsys.readouterr().err
