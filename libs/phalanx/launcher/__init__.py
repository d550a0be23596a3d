"""The node launcher: starts a node's ranks and hot spares, hosts the job's rendezvous, follows plans.

No module under this package imports torch (``tests/unit/test_layering.py`` checks the imports,
``tests/integration/test_launcher_store.py`` runs a launcher where torch cannot be imported): a
launcher runs on every node beside the ranks and must start in milliseconds. The job's store (torch's
``TCPStore``) runs in a child process (:mod:`phalanx.launcher.store`).

Modules: :mod:`~phalanx.launcher.launcher` (the :class:`Launcher`: join, plans, exits, fencing),
:mod:`~phalanx.launcher.config` (:class:`LaunchConfig`), :mod:`~phalanx.launcher.children` (starting
workers: environment, logins, logs), :mod:`~phalanx.launcher.starter` and
:mod:`~phalanx.launcher.forkserver` (workers forked warm from the node's fork server, or cold),
:mod:`~phalanx.launcher.restarts` (restart recovery of an unmodified torchrun script) and
:mod:`~phalanx.launcher.store` (the store process).
"""
