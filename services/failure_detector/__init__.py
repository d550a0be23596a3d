"""The failure-detector service: heartbeats, process exits and plans in; one
``RankFailed``/``RankHung`` per incident out.

- :mod:`.detector`: the algorithm (phi-accrual heartbeat loss, step stalls,
  collective hangs, process exits, incarnations), pure and clock-injected,
  composed of :mod:`.checks` (input checks), :mod:`.liveness` and :mod:`.phi`
  (the liveness estimate), :mod:`.rules` (verdict rules), :mod:`.tracking` and
  :mod:`.digests` (workers and nodes), :mod:`.mass` (mass hold) and
  :mod:`.deadlines` (the heap); :mod:`.verdicts` are what it decides;
- :mod:`.service`: :class:`FailureDetector`, the bus side, and its environment
  configuration;
- ``python -m phalanx.services.failure_detector`` runs it.
"""

from phalanx.services.failure_detector.config import DetectorConfig
from phalanx.services.failure_detector.detector import Detector
from phalanx.services.failure_detector.service import FailureDetector, ServiceConfig
from phalanx.services.failure_detector.verdicts import Incident, incident_id

__all__ = ["Detector", "DetectorConfig", "FailureDetector", "Incident", "ServiceConfig", "incident_id"]
