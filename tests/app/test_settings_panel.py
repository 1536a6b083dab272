"""The settings dialog: live re-planning, the memory chart, model and heads choices."""

from __future__ import annotations

from app.settings import ChatSettings, load_settings
from app.settings_panel import SettingsDialog

from .scripted import fake_inputs, fake_runtime


def test_slider_replans_live(qtbot):
    dialog = SettingsDialog(ChatSettings(prefer=0.0), fake_inputs())
    qtbot.addWidget(dialog)
    turns_end = dialog.plan
    text_turns = dialog.plan_label.text()
    assert turns_end.fits and turns_end.tree is None and "plain decoding" in text_turns
    dialog.slider.setValue(100)  # "more speed"
    speed_end = dialog.plan
    assert speed_end.tree is not None and speed_end.predicted_tokens_per_s > turns_end.predicted_tokens_per_s
    assert dialog.plan_label.text() != text_turns and f"{speed_end.turns} of 20 turns fit" in dialog.plan_label.text()
    assert dialog.chart.terms == speed_end.predicted_bytes and dialog.chart.terms["tree_buffers"] > 0
    dialog.turns.setValue(2)
    dialog.precision.setCurrentText("int4")
    assert dialog.plan.precision == "int4"
    assert dialog.settings().prefer == 1.0 and dialog.settings().precision == "int4"


def test_temperature_replans_with_room_for_sampling(qtbot):
    """Typical acceptance keeps every tree node's distribution, greedy one block of scores:
    raising the temperature above 0 re-plans with larger tree buffers."""
    dialog = SettingsDialog(ChatSettings(prefer=1.0), fake_inputs())
    qtbot.addWidget(dialog)
    greedy = dialog.plan
    assert greedy.tree is not None
    dialog.temperature.setValue(0.7)
    sampled = dialog.plan
    assert sampled is not greedy and sampled.fits
    assert sampled.predicted_bytes["tree_buffers"] > greedy.predicted_bytes["tree_buffers"] * (sampled.tree_nodes
                                                                                                / greedy.tree_nodes)


def test_plan_says_what_fits(qtbot):
    small = SettingsDialog(ChatSettings(), fake_inputs(free=2**30))
    qtbot.addWidget(small)
    assert small.plan.fits and small.plan.precision != "fp32"  # the planner steps precision down
    small.precision.setCurrentText("fp32")
    assert not small.plan.fits and "Does not fit" in small.plan_label.text()


def test_non_model_file_is_refused_and_previous_model_stays(qtbot, tmp_path):
    dialog = SettingsDialog(ChatSettings(model="default"), fake_inputs())
    qtbot.addWidget(dialog)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_text("not a model either")
    assert not dialog.choose_model(str(notes))
    assert "not a model" in dialog.model_error.text() and "previous model stays" in dialog.model_error.text()
    assert not dialog.choose_model(str(fake_gguf))
    assert not dialog.choose_model(str(tmp_path))  # a folder without config.json
    assert dialog.settings().model == "default"
    assert dialog.choose_model("default") and dialog.model_error.text() == ""


def test_bad_heads_path_is_refused(qtbot, tmp_path):
    dialog = SettingsDialog(ChatSettings(), fake_inputs())
    qtbot.addWidget(dialog)
    assert not dialog.choose_heads(str(tmp_path))
    assert "heads" in dialog.heads_error.text() and dialog.settings().heads == "auto"


def test_settings_apply_replans_and_persist(qtbot, make_window, folder):
    window = make_window(fake_runtime(settings=ChatSettings(prefer=0.0)))
    assert window.runtime.tree is None
    window.apply_settings(window.settings.with_(prefer=1.0, temperature=0.7, system_prompt="Be brief."))
    assert window.runtime.tree is not None and window.runtime.settings.temperature == 0.7
    assert f"tree {window.runtime.tree}" in window.chip.text() and "turns fit" in window.status.plan.text()
    assert load_settings(folder).system_prompt == "Be brief."
    dialog = window.settings_dialog()
    qtbot.addWidget(dialog)
    assert dialog.slider.value() == 100 and dialog.system_prompt.toPlainText() == "Be brief."


def test_plan_says_when_the_models_context_limits_the_turns(qtbot):
    """20 turns wanted, fewer fit: the text says the model's context is the limit (the plan's note), not memory."""
    dialog = SettingsDialog(ChatSettings(turns=20), fake_inputs())
    qtbot.addWidget(dialog)
    limit = dialog.inputs.model.max_context
    assert dialog.plan.turns < 20 and dialog.plan.kv_tokens == limit and dialog.plan.notes
    assert f"{dialog.plan.turns} of 20 turns fit: the model&#x27;s {limit}-token context is the limit" in \
        dialog.plan_label.text()
    dialog.turns.setValue(4)
    assert "<b>" + f"{dialog.plan.turns} turns fit</b>" in dialog.plan_label.text() and "limit" not in \
        dialog.plan_label.text()


def test_every_non_zero_memory_term_stays_visible_in_the_bar():
    """The tree buffers (a few MiB beside GiBs of weights) get the minimum width; zero terms none; the
    slices still fill the bar exactly, and the wide ones keep their proportions."""
    from app.memory_chart import MIN_SLICE_PX, gib, slice_widths

    gib_ = 2**30
    values = [gib_, 0, gib_ // 2, 2 * 2**20, gib_ // 4, gib_ // 4]
    widths = slice_widths(values, 400.0)
    assert widths[1] == 0.0 and widths[3] == MIN_SLICE_PX
    assert abs(sum(widths) - 400.0) < 1e-6
    assert abs(widths[0] / widths[2] - 2.0) < 1e-9 and abs(widths[4] - widths[5]) < 1e-9
    assert slice_widths([0, 0], 400.0) == [0.0, 0.0]
    assert gib(2 * 2**20) == "2 MiB" and gib(300 * 2**10) == "300 KiB" and gib(0) == "0 MiB"


def _offload_inputs():
    from specmemo_core.planning.entry import PlanInputs
    from specmemo_core.planning.memory import HeadsShape, known_shape
    from specmemo_core.planning.offload import HostLink
    from specmemo_core.planning.planner import Budget, specmemo_prior_options

    gib = 2**30
    return PlanInputs(Budget("cuda", 8 * gib, 8 * gib, "Test GPU"), known_shape("llama-3-8b"),
                      HeadsShape("hydra", 4, 1), tuple(specmemo_prior_options()), link=HostLink(64 * gib, 25e9))


def test_a_streamed_plan_shows_its_layers_and_the_slider_trades_turns_for_resident_layers(qtbot):
    dialog = SettingsDialog(ChatSettings(prefer=1.0, turns=4, precision="bf16"), _offload_inputs())
    qtbot.addWidget(dialog)
    speed = dialog.plan
    assert speed.fits and speed.streamed_layers > 0
    text = dialog.plan_label.text()
    assert f"{speed.resident_layers} of 32 layers on the GPU, {speed.streamed_layers} streamed from RAM" in text
    assert "GiB pinned" in text and f"{speed.predicted_tokens_per_s:.1f} tokens/s predicted" in text
    dialog.slider.setValue(0)  # more turns: the KV cache takes memory from the layers
    turns = dialog.plan
    assert turns.resident_layers < speed.resident_layers and turns.kv_tokens > speed.kv_tokens
    assert turns.turns > speed.turns and f"{turns.resident_layers} of 32 layers" in dialog.plan_label.text()
    dialog.slider.setValue(100)
    dialog.turns.setValue(12)  # more turns asked for: fewer resident layers at the same slider
    assert dialog.plan.resident_layers < speed.resident_layers


def test_settings_that_move_layers_reload_the_model():
    from dataclasses import replace

    from app.planning import make_plan

    runtime = fake_runtime()
    settings = ChatSettings(prefer=1.0, turns=4, precision="bf16")
    inputs = _offload_inputs()
    streamed = replace(runtime, inputs=inputs, plan=make_plan(inputs, settings), settings=settings)
    assert not streamed.needs_reload(settings)
    assert streamed.needs_reload(settings.with_(prefer=0.0))  # fewer resident layers
    assert not runtime.needs_reload(runtime.settings.with_(prefer=0.0))  # all resident: a replan will do
