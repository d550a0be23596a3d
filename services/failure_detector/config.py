"""The detector's tuning (:class:`DetectorConfig`), its counters (:class:`Stats`) and its clocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from phalanx.services.failure_detector.phi import phi_threshold_z

__all__ = ["Clock", "DetectorConfig", "Stats"]

Clock = Callable[[], float]
"""A clock in seconds: monotonic for deadlines, wall-clock for the times verdicts report."""


@dataclass(frozen=True)
class DetectorConfig:
    """Tuning of the detector; the defaults suit intervals from 50 ms to a few s.

    With the defaults a regular sender is declared lost ``~2.3`` intervals after
    its last heartbeat (``mu + 0.15 mu + 5.61 * 0.2 mu``): at most 3 intervals
    after the fault, with over one interval of lateness tolerated.
    """

    phi_threshold: float = 8.0
    window: int = 100
    """Inter-arrival samples kept per worker."""
    min_samples: int = 5
    """Below this many samples, use the declared interval and a wide std."""
    min_std_ratio: float = 0.2
    """Floor of sigma as a fraction of the mean interval (absorbs GC and scheduling jitter)."""
    min_std_s: float = 0.02
    """Absolute floor of sigma."""
    pause_ratio: float = 0.15
    """Acceptable extra pause, as a fraction of the mean interval, added to the mean."""
    stall_floor_s: float = 30.0
    """A rank in COMPUTE with nobody waiting for it (every member in an evaluation
    pass, a 1-rank job) stalls after ``max(stall_floor_s, stall_factor x its slowest
    recent step)``: long, since a pause every member takes harms nobody; a rank its
    peers wait for is judged by ``straggle_floor_s`` instead."""
    stall_factor: float = 4.0
    stall_initial_s: float = 60.0
    """Stall bound before the rank has reported any completed step."""
    straggle_floor_s: float = 1.5
    """A rank in COMPUTE while a peer of its generation waits in COLLECTIVE at the same
    step is the straggler once in COMPUTE past ``max(straggle_floor_s, stall_factor x
    max(the waiting peers' compute time of that step, its own slowest recent step))``,
    and no sooner than half the floor after the first peer began to wait: the peers'
    own pace of the step, not a constant, is the yardstick (a job's first step too)."""
    step_window: int = 20
    collective_slack_ratio: float = 0.25
    collective_slack_intervals: float = 2.0
    """A rank is left behind in COLLECTIVE once past its reported bound plus a slack,
    and at least that slack after a peer of its generation left: ``max(
    collective_slack_ratio x bound, collective_slack_intervals x its heartbeat
    interval)``, plus its node's digest interval. Peers blocked on the same hung
    rank time out within about one normal all-reduce of each other (a quarter of the
    bound with the trainer's factor 4), and their leaving is heard a heartbeat later."""
    worker_floor_s: float = 0.5
    """A worker is lost after at least this much silence, however regular its
    heartbeats were (``PHALANX_DETECTOR_WORKER_FLOOR_MS``; 0: phi alone): in a compose stack on two loaded
    cores, ranks' 100 ms heartbeats went quiet for 290 ms during a recovery and
    healthy ranks were replaced (phi's threshold for a regular 100 ms sender is about
    230 ms)."""
    node_floor_s: float = 0.75
    """The same for a node's launcher (``PHALANX_DETECTOR_NODE_FLOOR_MS``): a launcher's event loop stalled for
    a third of a second at a job's start (a 2-node compose stack on two loaded
    cores), over its digests' phi threshold, and a whole node's ranks were replaced."""
    digest_slack_ratio: float = 0.5
    """Added to a digest-carried worker's silence deadline, as a fraction of its
    node's digest interval: a heartbeat is seen only with the node's next digest."""
    closed_capacity: int = 100_000
    """Closed incarnations remembered (to drop their late heartbeats and repeated exits)."""
    seq_slack: int = 5
    """Heartbeats a sender may be ahead of the time since its last accepted one."""
    seq_rate: float = 2.0
    """How many times its own rate a sender's ``seq`` may advance (the bound's slope)."""
    mass_hold_s: float = 120.0
    """The longest a mass silence holds its job's silence verdicts when nothing confirms
    them (0: never held): longer than any stall the bus should have, shorter than the
    NATS server's own judgement of a dead client (two missed pings, 2 min apart by
    default), after which the probes answer "no responders" anyway (:mod:`.mass`)."""
    mass_probe_s: float = 0.5
    """How often the launchers of a mass silence's nodes are asked whether they are
    there, and how long an answer is awaited."""
    mass_ratio: float = 0.5
    """Share of a job's tracked workers (or nodes) silent at once that makes a mass silence."""
    mass_min: int = 2
    """...and at least this many of them."""

    def __post_init__(self) -> None:
        phi_threshold_z(self.phi_threshold)
        if self.window < 2 or self.step_window < 1 or self.min_samples < 2:
            raise ValueError("window >= 2, step_window >= 1 and min_samples >= 2 are required")
        if (
            self.min_std_ratio < 0
            or self.min_std_s <= 0
            or self.pause_ratio < 0
            or self.digest_slack_ratio < 0
        ):
            raise ValueError("std floors must be positive and pause_ratio non-negative")
        if (
            self.stall_floor_s <= 0
            or self.stall_factor <= 0
            or self.stall_initial_s <= 0
            or self.straggle_floor_s <= 0
        ):
            raise ValueError("stall bounds must be positive")
        if self.seq_slack < 1 or not self.seq_rate >= 1.0:
            raise ValueError("seq_slack >= 1 and seq_rate >= 1 are required")
        if not self.node_floor_s >= 0 or not self.worker_floor_s >= 0:
            raise ValueError("node_floor_s and worker_floor_s must be >= 0")
        if not self.mass_hold_s >= 0 or not 0 < self.mass_ratio <= 1 or self.mass_min < 1:
            raise ValueError("mass_hold_s >= 0, 0 < mass_ratio <= 1 and mass_min >= 1 are required")
        if not self.mass_probe_s > 0:
            raise ValueError("mass_probe_s must be positive")
        if self.collective_slack_ratio < 0 or self.collective_slack_intervals < 0:
            raise ValueError("collective slacks must be non-negative")


@dataclass
class Stats:
    """Counters of what the detector saw and decided (the service's health details)."""

    heartbeats: int = 0
    ignored_heartbeats: int = 0
    """From closed incarnations, or repeated/out-of-order sequence numbers."""
    incidents: int = 0
    clean_exits: int = 0
    repeated_exits: int = 0
    """Exit reports for closed incarnations (a duplicate, or after another verdict)."""
    stale_plans: int = 0
    holds: int = 0
    digests: int = 0
    ignored_digests: int = 0
    """Repeated/out-of-order digests, or from a launcher already judged lost."""
    digest_entries: int = 0
    """Digest entries that carried a new heartbeat (each counts as a heartbeat too)."""
    nodes_lost: int = 0
    nodes_left: int = 0
    """Nodes that fell silent with no worker in their last digest: forgotten, no verdict."""
    registrations: int = 0
    stale_registrations: int = 0
    """Registrations older than the known one, or of a closed incarnation: ignored."""
    displaced: int = 0
    """Tracked incarnations dropped because the worker registered another pid."""
    refused_pid: int = 0
    """Heartbeats and digest entries whose pid is not the worker's registered one."""
    refused_seq: int = 0
    """Heartbeats, digest entries and digests whose seq was beyond the sequence bound."""
    refused_node: int = 0
    """Digest entries and exit reports about a worker of another node than the sender's."""
    seq_resyncs: int = 0
    """Heartbeats that showed a second sender under one pid (see "stale and resync")."""
    mass_holds: int = 0
    mass_held: int = 0
    """Verdicts published after a mass-silence hold (their members stayed silent)."""
    mass_probes: int = 0
    """Answers (or their absence) to the detector's questions to held nodes' launchers."""
    mass_confirmed: int = 0
    """Mass-silence holds a survivor's failed collective ended early."""
