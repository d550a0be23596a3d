"""The failure-detector service: heartbeats, process exits and plans in; one
``RankFailed``/``RankHung`` per incident out.

- :mod:`.detector`: the algorithm (phi-accrual heartbeat loss, step stalls,
  process exits, incarnations), pure and clock-injected;
- :mod:`.service`: :class:`FailureDetector`, the bus side, and its environment
  configuration;
- ``python -m phalanx.services.failure_detector`` runs it.
"""

from phalanx.services.failure_detector.detector import Detector, DetectorConfig, Incident, incident_id
from phalanx.services.failure_detector.service import FailureDetector, ServiceConfig

__all__ = ["Detector", "DetectorConfig", "FailureDetector", "Incident", "ServiceConfig", "incident_id"]
