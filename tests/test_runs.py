"""`moonvit.runs`: the "same run?" comparison shared by the export's run.json and the trainer's resume."""

from __future__ import annotations

from moonvit.runs import describe_differences, differences


def test_differences_are_dotted_sorted_and_name_a_missing_key():
    before = {"dtype": "bf16", "arguments": {"store": "both", "threads": 1}, "gone": 1}
    after = {"dtype": "fp32", "arguments": {"store": "both", "threads": 2}, "new": [1]}
    assert differences(before, after) == [
        ("arguments.threads", 1, 2),
        ("dtype", "bf16", "fp32"),
        ("gone", 1, "(absent)"),
        ("new", "(absent)", [1]),
    ]
    assert differences(before, before) == []


def test_a_missing_key_can_stand_for_none():
    assert differences({"--seed": None}, {}, absent=None) == []
    assert differences({"--lr": 0.003}, {}, absent=None) == [("--lr", 0.003, None)]


def test_describe_differences_formats_each_with_both_values():
    changes = [("a.b", 1, 2), ("c", "x", "y")]
    assert describe_differences(changes) == "a.b: 1 there, 2 now; c: 'x' there, 'y' now"
    assert describe_differences(changes[:1], "{key} = {before!r}, but this command gives {after!r}") == (
        "a.b = 1, but this command gives 2"
    )
