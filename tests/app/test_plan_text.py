"""A plan split over GPUs in words (app/plan_text.py), as the settings panel shows it."""

from specmemo_core.planning.planner import Plan
from specmemo_core.planning.split import DeviceShare

from app.plan_text import split_text
from app.settings_panel import describe_plan
from app.settings import ChatSettings

GIB = 2**30


def _plan(*shares: DeviceShare) -> Plan:
    return Plan(True, "cuda", "bf16", 0, None, 1, 2048, 4, {"weights": 26 * GIB}, 28 * GIB, split=shares)


def test_a_split_plan_names_each_cards_layers_and_bytes():
    split = _plan(DeviceShare("cuda:0", 0, 20, int(13.9 * GIB), 14 * GIB),
                  DeviceShare("cuda:1", 20, 20, int(14.3 * GIB), 14 * GIB))
    assert split_text(split) == ("layers split over 2 GPUs: cuda:0 layers 0–19 (13.9 GiB), "
                                 "cuda:1 layers 20–39 (14.3 GiB)")
    assert "layers split over 2 GPUs" in describe_plan(split, ChatSettings(), 2048)


def test_a_plan_on_one_card_says_nothing_of_a_split():
    one = _plan(DeviceShare("cuda:1", 0, 40, 20 * GIB, 70 * GIB))
    assert split_text(one) == "" == split_text(_plan())
    assert "split" not in describe_plan(one, ChatSettings(), 2048)
