# Whether a wait for the peer should spin before it parks. Both ends of a connection wait the same way: the
# daemon for its client's next call (mpsd.daemon.channel), a blocking client for its reply (mpsd_client._wait).
# A spin costs the core it runs on for the whole window when the peer is slow, so each wait keeps a moving
# average of how often its spins lately ended with what they waited for, and where that falls under a quarter
# it spins only once in PROBE waits: an idle or slow peer costs a window now and then, not each time.
from __future__ import annotations

MEMORY = 8  # spins the moving average remembers, about
HITS = 0.25  # below this share of hits a wait spins only once in PROBE
PROBE = 32


class SpinOdds:
    """How often one wait's spins have lately ended with a hit, and so whether the next should spin."""

    __slots__ = ("rate", "waits")

    def __init__(self) -> None:
        self.rate = 1.0
        self.waits = 0

    def worth(self) -> bool:
        """Whether this wait should spin (counts the wait)."""
        self.waits += 1
        return self.rate >= HITS or self.waits % PROBE == 0

    def hit(self) -> None:
        self.rate += (1.0 - self.rate) / MEMORY

    def miss(self) -> None:
        self.rate -= self.rate / MEMORY
