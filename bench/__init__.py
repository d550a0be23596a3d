"""Benchmarks: Phalanx recovery and overhead measurements, and the baselines they are compared with."""
