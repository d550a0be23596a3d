"""Phalanx: keep PyTorch training running through failures and capacity changes.

The library holds what every service and every training rank shares: the message
schemas (:mod:`phalanx.contract`), the NATS bus layer (:mod:`phalanx.bus`),
telemetry (:mod:`phalanx.telemetry`), an embedded nats-server launcher
(:mod:`phalanx.devstack.natsserver`) and the runtime that ranks embed (:mod:`phalanx.runtime`).
"""

__version__ = "0.1.0"
