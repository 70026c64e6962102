"""The action IR: one unit of pipeline work, and the error every schedule check raises.

A schedule is nothing more than, for every device, an ordered list of ``Action``s.
An action names *what* runs (``kind``), *which* pipeline stage runs it (``stage``)
and *on which* microbatch (``microbatch``):

- ``"F"`` forward of the stage; produces the residuals its backward will need.
- ``"B"`` full backward (gradients w.r.t. the stage input *and* its parameters);
  frees the residuals.
- ``"I"`` backward w.r.t. the stage input only (the cotangent the previous stage
  waits for). Zero-bubble style schedules run it early ...
- ``"W"`` ... and the weight-gradient half later, to fill bubbles. ``W`` frees the
  residuals. A (stage, microbatch) uses either ``B`` or the pair ``I`` + ``W``.

``str(Action("F", 2, 0)) == "2F0"``: stage, kind, microbatch — the notation used in
timelines, error messages and :meth:`Action.parse`.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

#: The action kinds, in the order they appear in legends.
ACTION_KINDS: tuple[str, ...] = ("F", "B", "I", "W")

#: Human-readable name of each kind (used in legends and messages).
KIND_NAMES: dict[str, str] = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input grad)",
    "W": "backward (weight grad)",
}

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z])\s*(\d+)\s*$")


class ScheduleError(ValueError):
    """A schedule is invalid or cannot be built.

    The message names the device, the action (``"2F0"`` form) and the broken rule,
    so a schedule author can find the offending entry of ``device_actions``.
    Subclasses ``ValueError`` so generic argument handling still catches it.
    """


def _index(name: str, value: object) -> int:
    """Coerce an index-like value (int, numpy integer) to ``int``; reject the rest."""
    if isinstance(value, bool):
        raise ScheduleError(f"Action {name} must be an int, got a bool ({value!r})")
    try:
        index = operator.index(value)
    except TypeError:
        raise ScheduleError(
            f"Action {name} must be an int, got {type(value).__name__} {value!r}"
        ) from None
    if index < 0:
        raise ScheduleError(f"Action {name} must be >= 0, got {index}")
    return index


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: ``kind`` of ``stage`` on ``microbatch``.

    Frozen and hashable, so actions can be dictionary keys and set members.

    >>> a = Action("F", 2, 0)
    >>> str(a)
    '2F0'
    >>> Action.parse("12W3")
    Action(kind='W', stage=12, microbatch=3)
    """

    kind: str
    stage: int
    microbatch: int

    def __init__(self, kind: str, stage: int, microbatch: int) -> None:
        # Written out instead of the dataclass's __init__ + __post_init__: schedules at
        # scale build hundreds of thousands of actions, and this is twice as fast.
        if kind not in ACTION_KINDS:
            raise ScheduleError(
                f"Action kind must be one of {', '.join(ACTION_KINDS)} "
                f"(forward, backward, input-grad, weight-grad), got {kind!r}"
            )
        # Normalise numpy integers to int so equality/hashing never depend on dtype (the
        # common case, plain non-negative ints, skips the checks).
        if not (type(stage) is int and stage >= 0):
            stage = _index("stage", stage)
        if not (type(microbatch) is int and microbatch >= 0):
            microbatch = _index("microbatch", microbatch)
        fields = self.__dict__  # frozen: no __setattr__
        fields["kind"], fields["stage"], fields["microbatch"] = kind, stage, microbatch
        fields["_hash"] = hash((kind, stage, microbatch))

    def __hash__(self) -> int:
        # computed once: actions are dictionary keys everywhere in validation and lowering
        return self._hash  # type: ignore[attr-defined]

    def __reduce__(self) -> tuple:
        # rebuild (and rehash) on unpickling: string hashes differ between processes
        return (Action, (self.kind, self.stage, self.microbatch))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the ``"<stage><kind><microbatch>"`` form, e.g. ``"2F0"`` or ``"12W3"``.

        Whitespace around the parts is ignored and the kind may be lower case.
        Raises :class:`ScheduleError` (a ``ValueError``) naming the text and the expected
        form.
        """
        if not isinstance(text, str):
            raise ScheduleError(f"Action.parse expects a str like '2F0', got {type(text).__name__}")
        match = _ACTION_RE.match(text)
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected '<stage><kind><microbatch>' "
                f"like '2F0', with kind one of {', '.join(ACTION_KINDS)}"
            )
        stage, kind, microbatch = match.groups()
        kind = kind.upper()
        if kind not in ACTION_KINDS:
            raise ScheduleError(
                f"cannot parse action {text!r}: kind {kind!r} is not one of "
                f"{', '.join(ACTION_KINDS)}"
            )
        return cls(kind, int(stage), int(microbatch))

    @property
    def is_forward(self) -> bool:
        """True for ``F``."""
        return self.kind == "F"

    @property
    def is_backward(self) -> bool:
        """True for ``B``, ``I`` and ``W`` (any part of the backward pass)."""
        return self.kind != "F"
