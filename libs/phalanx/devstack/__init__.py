"""The development harness: embedded nats-server and S3 server, the local stack, network-namespace nodes, the demo.

Nothing in the product imports this package; the CLI (``phalanx up``, ``phalanx run`` without a
``NATS_URL``), the demo, the benchmarks and the tests do.
"""
