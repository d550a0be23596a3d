"""Which checkpoints a tier keeps (``PHALANX_CKPT_KEEP_*``).

Apart from the tiers so that :mod:`phalanx.settings` can refuse a bad value at
start without importing the tiers (which log, and so import the settings).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetentionPolicy:
    """Which checkpoints a tier keeps: the newest ``keep_last``, and every one whose
    step is a multiple of ``keep_every`` (0: none such).

    >>> RetentionPolicy.parse("last=2,every=100").expired([0, 50, 100, 150, 200, 250])
    [50, 150]
    >>> RetentionPolicy.parse("3").expired([1, 2, 3, 4])
    [1]
    """

    keep_last: int
    keep_every: int = 0

    def __post_init__(self) -> None:
        if self.keep_last < 1 or self.keep_every < 0:
            raise ValueError(f"retention keeps at least the newest 1 and every >= 0, got {self}")

    @classmethod
    def parse(cls, text: str) -> RetentionPolicy:
        """``N`` or ``last=N[,every=M]``; a ValueError saying what is wrong otherwise."""
        fields: dict[str, int] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep:
                key, value = "last", key
            if key not in ("last", "every") or key in fields:
                raise ValueError(f"retention {text!r}: expected 'N' or 'last=N,every=M'")
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"retention {text!r}: {value!r} is not a whole number") from None
        if "last" not in fields:
            raise ValueError(f"retention {text!r}: 'last=N' is required")
        try:
            return cls(fields["last"], fields.get("every", 0))
        except ValueError as exc:
            raise ValueError(f"retention {text!r}: {exc}") from None

    def expired(self, steps: list[int]) -> list[int]:
        ordered = sorted(set(steps))
        keep = set(ordered[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in ordered if s % self.keep_every == 0}
        return [s for s in ordered if s not in keep]
