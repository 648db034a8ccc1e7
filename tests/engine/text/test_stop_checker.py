"""Stop strings across token boundaries: nothing emitted that a later token would retract."""

from __future__ import annotations

from services.engine.text.stop_checker import StopChecker


def _run(stops: tuple[str, ...], deltas: list[str]) -> tuple[str, bool]:
    checker = StopChecker(stops)
    emitted = []
    for delta in deltas:
        text, is_stopped = checker.push(delta)
        emitted.append(text)
        if is_stopped:
            return "".join(emitted), True
    return "".join(emitted) + checker.flush(), False


def test_stop_split_across_deltas_is_cut_before_it() -> None:
    assert _run(("END",), ["Hello E", "N", "D and more"]) == ("Hello ", True)


def test_partial_match_is_held_then_released() -> None:
    checker = StopChecker(("###",))
    assert checker.push("abc#").text == "abc"
    assert checker.push("#").text == ""
    assert checker.push("x").text == "##x"


def test_earliest_of_several_stops_wins() -> None:
    assert _run(("world", "lo w"), ["hello world"]) == ("hel", True)


def test_held_text_is_flushed_when_generation_ends_otherwise() -> None:
    assert _run(("\n\n",), ["line one\n"]) == ("line one\n", False)


def test_no_stops_passes_text_through() -> None:
    assert StopChecker(()).push("anything").text == "anything"
