"""TimerQueue: keyed deadlines with replace-on-reschedule, checked by example and against a
dict that holds each key's one due time."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.worker.tier.timers import TimerQueue


def test_pop_due_returns_due_keys_earliest_first_and_forgets_them() -> None:
    timers: TimerQueue[str] = TimerQueue()
    for key, due in [("c", 3.0), ("a", 1.0), ("d", 10.0), ("b", 2.0)]:
        timers.schedule(key, due)

    assert timers.pop_due(2.5) == ["a", "b"]
    assert len(timers) == 2
    assert "a" not in timers and "b" not in timers and "c" in timers
    assert timers.pop_due(2.5) == []
    assert timers.pop_due(3.0) == ["c"]  # due at `now` is due
    assert timers.pop_due(100.0) == ["d"]
    assert len(timers) == 0 and timers.next_due() is None


def test_rescheduling_replaces_the_due_time() -> None:
    timers: TimerQueue[str] = TimerQueue()
    timers.schedule("later", 1.0)
    timers.schedule("later", 5.0)
    timers.schedule("sooner", 5.0)
    timers.schedule("sooner", 2.0)

    assert len(timers) == 2
    assert timers.pop_due(1.0) == []  # the old time of "later" never fires
    assert timers.pop_due(4.0) == ["sooner"]
    assert timers.next_due() == 5.0  # "sooner"'s old entry is not a due time any more
    assert timers.pop_due(5.0) == ["later"]
    assert timers.pop_due(float("inf")) == []


def test_a_key_rescheduled_back_to_its_old_time_fires_once() -> None:
    timers: TimerQueue[str] = TimerQueue()
    timers.schedule("k", 5.0)
    timers.schedule("k", 7.0)
    timers.schedule("k", 5.0)

    assert timers.pop_due(10.0) == ["k"]
    assert timers.pop_due(10.0) == []


def test_cancel_forgets_a_key_until_it_is_scheduled_again() -> None:
    timers: TimerQueue[str] = TimerQueue()
    timers.schedule("gone", 1.0)
    timers.schedule("kept", 2.0)
    timers.cancel("gone")
    timers.cancel("never scheduled")  # not an error

    assert "gone" not in timers and len(timers) == 1
    assert timers.pop_due(5.0) == ["kept"]

    timers.schedule("gone", 6.0)
    assert timers.pop_due(6.0) == ["gone"]


def test_next_due_skips_cancelled_and_replaced_entries() -> None:
    timers: TimerQueue[str] = TimerQueue()
    assert timers.next_due() is None
    timers.schedule("cancelled", 1.0)
    timers.schedule("moved", 2.0)
    timers.schedule("moved", 9.0)
    timers.schedule("kept", 4.0)
    timers.cancel("cancelled")

    assert timers.next_due() == 4.0
    timers.cancel("kept")
    assert timers.next_due() == 9.0
    timers.cancel("moved")
    assert timers.next_due() is None


class Unordered:
    """A key that can be hashed and compared for equality, but not ordered."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unordered) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def test_keys_need_not_be_orderable() -> None:
    unordered: TimerQueue[Unordered] = TimerQueue()
    keys = [Unordered(name) for name in "abcde"]
    for key in keys:
        unordered.schedule(key, 1.0)  # equal due times: a heap would compare the keys
    fired = unordered.pop_due(1.0)
    assert len(fired) == len(keys) and set(fired) == set(keys)

    # Retry keys: equal handoff ids, then an int against a str would raise TypeError.
    handoff_id = uuid.uuid4()
    mixed: TimerQueue[tuple[uuid.UUID, object]] = TimerQueue()
    mixed.schedule((handoff_id, 1), 1.0)
    mixed.schedule((handoff_id, "deadline"), 1.0)
    mixed.schedule((handoff_id, None), 1.0)
    assert set(mixed.pop_due(1.0)) == {
        (handoff_id, 1),
        (handoff_id, "deadline"),
        (handoff_id, None),
    }


def test_len_and_contains_count_each_key_once() -> None:
    timers: TimerQueue[int] = TimerQueue()
    for due in (3.0, 1.0, 2.0):
        timers.schedule(7, due)
    timers.schedule(8, 1.0)

    assert len(timers) == 2
    assert 7 in timers and 8 in timers and 9 not in timers
    assert timers.pop_due(1.0) == [8]
    assert len(timers) == 1 and 7 in timers


Operation = tuple[str, int, int]
operations = st.lists(
    st.tuples(
        st.sampled_from(["schedule", "cancel", "pop_due", "next_due"]),
        st.integers(0, 5),  # few keys, so they are rescheduled and cancelled often
        st.integers(0, 20),  # few times, so they tie
    ),
    max_size=60,
)


@given(operations)
def test_timer_queue_behaves_like_a_dict_of_due_times(ops: list[Operation]) -> None:
    timers: TimerQueue[int] = TimerQueue()
    model: dict[int, float] = {}
    for name, key, time in ops:
        if name == "schedule":
            timers.schedule(key, float(time))
            model[key] = float(time)
        elif name == "cancel":
            timers.cancel(key)
            model.pop(key, None)
        elif name == "pop_due":
            fired = timers.pop_due(float(time))
            due = {k for k, t in model.items() if t <= time}
            assert len(fired) == len(due) and set(fired) == due
            times = [model[k] for k in fired]
            assert times == sorted(times), "earliest first"
            for k in fired:
                del model[k]
        else:
            assert timers.next_due() == min(model.values(), default=None)
        assert len(timers) == len(model)
        assert all((k in timers) == (k in model) for k in range(6))
