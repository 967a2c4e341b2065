import pytest

from hardeq.diffusion import EndSpaced, StartEnd, StartSpaced, Steps, Uniform
from hardeq.diffusion.schedules import resolve_steps


@pytest.mark.parametrize("schedule, expected", [
    (Uniform(1), (9,)),
    (Uniform(2), (4, 9)),
    (Uniform(4), (1, 4, 6, 9)),
    (Uniform(5), (1, 3, 5, 7, 9)),
    (Uniform(10), tuple(range(10))),
    (StartEnd(3, 3), (0, 1, 2, 7, 8, 9)),
    (StartEnd(3, 1), (0, 1, 2, 9)),
    (StartEnd(1, 0), (0,)),
    (StartEnd(0, 1), (9,)),
    (StartEnd(5, 5), tuple(range(10))),
    (StartSpaced(4, 1), (0, 1, 2, 3)),
    (StartSpaced(4, 2), (0, 2, 4, 6)),
    (StartSpaced(4, 3), (0, 3, 6, 9)),
    (EndSpaced(4, 3), (0, 3, 6, 9)),
    (EndSpaced(4, 2), (3, 5, 7, 9)),
    (EndSpaced(3, 1), (7, 8, 9)),
    (EndSpaced(1, 1), (9,)),
    (Steps((0, -1)), (0, 9)),
    (Steps(()), ()),
])
def test_steps_for_ten(schedule, expected):
    assert schedule.steps(10) == expected
    assert schedule.includes_last(10) == (9 in expected)


def test_uniform_fifty_steps():
    assert Uniform(4).steps(50) == (11, 24, 36, 49)
    assert StartSpaced(4, 1).steps(50) == (0, 1, 2, 3)
    assert EndSpaced(4, 3).steps(50) == (40, 43, 46, 49)


def test_repr_label_and_frozen():
    assert repr(StartEnd(3, 3)) == "StartEnd(3, 3)"
    assert repr(Uniform(4)) == "Uniform(4)"
    assert repr(StartSpaced(4, 2)) == "StartSpaced(4, 2)"
    assert repr(EndSpaced(4, 3)) == "EndSpaced(4, 3)"
    assert [str(s) for s in (Uniform(4), StartEnd(3, 1), StartSpaced(4, 2), EndSpaced(4, 3))] == [
        "Uniform 4", "Start 3 End 1", "Start 4 Space 2", "End 4 Space 3"]
    assert StartEnd(3, 1) == StartEnd(3, 1) and hash(StartEnd(3, 1)) == hash(StartEnd(3, 1))
    with pytest.raises(AttributeError):
        StartEnd(3, 1).start = 2


@pytest.mark.parametrize("make, match", [
    (lambda: Uniform(0), "n must be positive, got n = 0"),
    (lambda: Uniform(-2), "n must be positive"),
    (lambda: StartSpaced(0, 1), "n must be positive"),
    (lambda: StartSpaced(2, 0), "spacing must be positive, got spacing = 0"),
    (lambda: EndSpaced(3, -1), "spacing must be positive"),
    (lambda: StartEnd(-1, 2), "start must be >= 0"),
    (lambda: StartEnd(0, 0), "start \\+ end must be positive"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make", [lambda: Uniform(2.0), lambda: StartEnd(True, 1), lambda: EndSpaced("3", 1),
                                  lambda: Steps((0, 1.5))])
def test_bad_types(make):
    with pytest.raises(TypeError, match="must be"):
        make()


@pytest.mark.parametrize("schedule", [Uniform(11), StartEnd(6, 5), StartSpaced(4, 4), EndSpaced(6, 2),
                                      Steps((10,))])
def test_more_steps_than_exist(schedule):
    with pytest.raises(ValueError, match="num_steps = 10|out of range"):
        schedule.steps(10)


def test_num_steps_checked():
    with pytest.raises(ValueError, match="num_steps must be positive"):
        Uniform(1).steps(0)


def test_resolve_steps():
    assert resolve_steps(None, 5, default_last=True) == {4}
    assert resolve_steps(None, 5, default_last=False) == frozenset()
    assert resolve_steps([0, 2], 5, default_last=True) == {0, 2}
    assert resolve_steps((), 5, default_last=True) == frozenset()
    with pytest.raises(TypeError, match="schedule must be"):
        resolve_steps("last", 5, default_last=True)
