"""The bus side of a worker process, without torch: the agent a rank embeds (heartbeats, plan
following, status), node digests, and the severing of a dead peer's sockets.

Both the rank runtime (:mod:`phalanx.runtime`) and the launcher (:mod:`phalanx.launcher`) build on it.
"""
