"""A served run's parts on their own, without threads: the pacing rules the worker obeys, and the
viewers' queues and shared resync messages."""

from __future__ import annotations

import pytest

from kvscope.backend.server.run_errors import RunBusy, RunError
from kvscope.backend.server.run_pacing import Pacer
from kvscope.backend.server.run_viewers import Viewers

# ---- pacing -------------------------------------------------------------------------------------------


def test_steps_asked_for_while_paused_are_owed_one_by_one_and_a_pause_forgets_them():
    pacing = Pacer(speed=4.0)
    pacing.apply("step", 3)
    assert (pacing.paused, pacing.steps_requested) == (True, 3)
    assert [pacing.take_manual_step() for _ in range(4)] == [True, True, True, False]
    pacing.apply("step", 1_000_000)
    pacing.apply("pause", None)
    assert (pacing.paused, pacing.steps_requested, pacing.may_step(has_work=True)) == (True, 0, False)


def test_a_paused_run_steps_only_when_it_has_work_and_a_step_is_owed():
    pacing = Pacer(paused=True)
    assert not pacing.may_step(has_work=True)
    pacing.apply("step", None)
    assert pacing.may_step(has_work=True) and not pacing.may_step(has_work=False)
    pacing.apply("resume", None)
    assert (pacing.paused, pacing.steps_requested, pacing.may_step(has_work=True)) == (False, 0, True)


@pytest.mark.parametrize("action, value, field", [("jump", None, "action"), ("speed", -1, "value"),
                                                  ("speed", None, "value"), ("lesson", 2, "value"),
                                                  ("seek", -1, "value")])
def test_a_control_that_is_not_one_changes_nothing(action, value, field):
    pacing = Pacer(speed=2.0, paused=True)
    pacing.apply("step", 5)
    touched = pacing.touched
    with pytest.raises(RunError) as refused:
        pacing.apply(action, value)
    assert refused.value.field == field
    assert (pacing.speed, pacing.paused, pacing.steps_requested, pacing.touched) == (2.0, True, 5, touched)


def test_the_runs_pacing_and_a_dashboards_mirror_of_its_control_events_agree():
    """One definition of what a control does to the pacing: the server's Pacer applies it, a dashboard
    applies the control event it records, and both say the same after every control."""
    from kvscope.backend.events.pacing import Pacing

    pacer, mirror = Pacer(speed=4.0, paused=True), Pacing.from_snapshot({"paused": True, "speed": 4.0})
    for action, value in [("step", 2), ("resume", None), ("speed", 0), ("lesson", 1), ("pause", None),
                          ("seek", 3), ("speed", 2.5), ("resume", None), ("lesson", 0), ("step", None)]:
        pacer.apply(action, value)
        mirror.apply_control({"type": "control", "action": action, "value": value})
        assert pacer.view() == mirror, (action, value)


def test_a_paced_iteration_is_due_one_period_after_the_last_and_a_late_one_is_not_caught_up():
    pacing = Pacer(speed=4.0)
    assert pacing.next_due(previous=10.0, now=10.1) == 10.25
    assert pacing.next_due(previous=10.0, now=12.0) == 12.0  # late: now, not a burst of the missed ones


def test_a_run_paused_and_untouched_past_its_ttl_may_expire_and_a_control_touches_it():
    pacing = Pacer(paused=True)
    pacing.touched = 100.0
    assert pacing.idle_past(60.0, now=161.0) and not pacing.idle_past(60.0, now=159.0)
    assert not pacing.idle_past(None, now=1e9)
    pacing.apply("speed", 1)
    assert not pacing.idle_past(60.0, now=pacing.touched + 59.0)
    pacing.apply("resume", None)
    assert not pacing.idle_past(60.0, now=pacing.touched + 1e6)  # running: never idle


# ---- viewers ------------------------------------------------------------------------------------------


def test_a_viewer_starts_from_a_resync_message_then_gets_the_events_after_it():
    viewers, woken = Viewers("r", max_viewers=None), []
    watcher = viewers.add(lambda: woken.append(1), wants_past=False)
    viewers.offer("e0")  # before its first resync: in the message already
    assert viewers.take(watcher, 10, lambda past: "snap") == ("snap", [])
    viewers.offer("e1")
    viewers.offer("e2")
    assert (viewers.take(watcher, 10, lambda past: "unused"), woken) == ((None, ["e1", "e2"]), [1])


def test_viewers_that_fall_behind_share_one_resync_message_and_the_events_since():
    viewers, built = Viewers("r", max_viewers=None, queue_limit=8), []

    def resync_text(with_past: bool) -> str:
        built.append(with_past)
        return f"snap{len(built)}"

    a, b = (viewers.add(lambda: None, wants_past=False) for _ in range(2))
    assert [viewers.take(w, 10, resync_text) for w in (a, b)] == [("snap1", [])] * 2  # one message for both
    for i in range(9):  # one more than a queue holds: both are dropped
        viewers.offer(f"e{i}")
    assert a.needs_snapshot and b.needs_snapshot and a.dropped == b.dropped == 8
    assert viewers.take(a, 10, resync_text) == ("snap2", [])  # snap1 has too many events since: a fresh one
    viewers.offer("e9")
    assert viewers.take(b, 10, resync_text) == ("snap2", ["e9"])  # the same message, and the event since
    assert built == [False, False]


def test_a_run_refuses_a_viewer_past_max_viewers():
    viewers = Viewers("r", max_viewers=1)
    viewers.add(lambda: None, wants_past=False)
    with pytest.raises(RunBusy, match="has 1 viewers already"):
        viewers.add(lambda: None, wants_past=True)
