"""What a CPU worker admits: one mode and the transitions the admin routes make. Pure logic.

    open --pause--> paused --hold (pause mode "keep")--> holding      (any --resume--> open
     |                 |                                    |          unless asleep)
     +--sleep--> asleep <--resume-- paused_asleep <--sleep--+
                   |                   |
                   +--wake--> open     +--wake--> paused
    any --close--> closed (final)

Asleep, nothing non-probe is in flight (a sleep aborts it, and nothing is admitted), so
there is no output to hold: a keep-pause while asleep, or a sleep while holding, is just
paused and asleep. The engine's replacement (`CpuWorker._reset_engine`) is not a mode: it
happens inside an admin operation, in any mode, and holds admission meanwhile.
"""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    OPEN = "open"  # requests are admitted and their output flows
    PAUSED = "paused"  # new requests wait; what is in flight goes on (pause "wait"/"abort")
    HOLDING = "holding"  # paused, and the output in flight is held back too (pause "keep")
    ASLEEP = "asleep"  # control/sleep: nothing admitted until wake_up
    PAUSED_ASLEEP = "paused_asleep"  # asleep, and still paused once woken
    CLOSED = "closed"  # shutting down: nothing waits any more

    @property
    def admits(self) -> bool:
        """Whether a new request (not a health probe) is admitted."""
        return self is Mode.OPEN

    @property
    def paused(self) -> bool:
        return self in {Mode.PAUSED, Mode.HOLDING, Mode.PAUSED_ASLEEP}

    @property
    def asleep(self) -> bool:
        return self in {Mode.ASLEEP, Mode.PAUSED_ASLEEP}


class Event(StrEnum):
    PAUSE = "pause"
    HOLD = "hold"  # pause, and hold back the output in flight
    RESUME = "resume"
    SLEEP = "sleep"
    WAKE = "wake"
    CLOSE = "close"


_AWAKE_PAUSE = {Event.PAUSE: Mode.PAUSED, Event.HOLD: Mode.HOLDING, Event.RESUME: Mode.OPEN}

TRANSITIONS: dict[Mode, dict[Event, Mode]] = {
    Mode.OPEN: {**_AWAKE_PAUSE, Event.SLEEP: Mode.ASLEEP, Event.WAKE: Mode.OPEN},
    Mode.PAUSED: {**_AWAKE_PAUSE, Event.SLEEP: Mode.PAUSED_ASLEEP, Event.WAKE: Mode.PAUSED},
    Mode.HOLDING: {**_AWAKE_PAUSE, Event.SLEEP: Mode.PAUSED_ASLEEP, Event.WAKE: Mode.HOLDING},
    Mode.ASLEEP: {
        Event.PAUSE: Mode.PAUSED_ASLEEP,
        Event.HOLD: Mode.PAUSED_ASLEEP,
        Event.RESUME: Mode.ASLEEP,
        Event.SLEEP: Mode.ASLEEP,
        Event.WAKE: Mode.OPEN,
    },
    Mode.PAUSED_ASLEEP: {
        Event.PAUSE: Mode.PAUSED_ASLEEP,
        Event.HOLD: Mode.PAUSED_ASLEEP,
        Event.RESUME: Mode.ASLEEP,
        Event.SLEEP: Mode.PAUSED_ASLEEP,
        Event.WAKE: Mode.PAUSED,
    },
    Mode.CLOSED: {},
}


def after(mode: Mode, event: Event) -> Mode:
    """The mode `event` leads to from `mode`; closing is final."""
    if event is Event.CLOSE or mode is Mode.CLOSED:
        return Mode.CLOSED
    return TRANSITIONS[mode][event]
