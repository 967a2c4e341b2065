"""The wall time a report prints (hardeq_studies.results.wall_time): the total across legs where the run document
records it, else the study's own key, labelled "last leg" when the run was resumed."""

from __future__ import annotations

from hardeq_studies.results import wall_time


def test_total_across_legs_when_recorded_top_level_or_under_timing():
    assert wall_time({"wall_seconds_total": 5520.0, "resumed_legs": [3899.0, 1621.0], "command": "x --resume"},
                     1621.0) == (5520.0, "total across the 2 legs of a resumed run: 3,899 + 1,621 s")
    # resumed, but only its last leg recorded (the earlier one ran before legs were recorded): said so
    assert wall_time({"wall_seconds_total": 7092.0, "resumed_legs": [7092.0], "resumed": True,
                      "command": "x --resume"}, 7092.0) == (
        7092.0, "the last leg of a resumed run; its earlier legs are not recorded")
    # an uninterrupted run records its one leg: that is the total, not a resumed run
    assert wall_time({"wall_seconds_total": 75.0, "resumed_legs": [75.0], "resumed": False, "command": "x"},
                     75.0) == (75.0, "total")
    assert wall_time({"timing": {"wall_seconds_total": 90.0}, "command": "x"}, 80.0) == (90.0, "total")


def test_falls_back_to_the_study_key_and_says_when_it_is_only_the_last_leg():
    seconds, label = wall_time({"command": "hardeq reproduce mof --preset cpu --resume"}, 1620.75)
    assert seconds == 1620.75 and label.startswith("last leg")
    assert wall_time({"command": "hardeq reproduce mof --preset cpu"}, 10.0) == (10.0, "total")
    assert wall_time({}, None) == (None, "total")
